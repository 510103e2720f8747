"""Every parallel layout gives the single-device greedy tokens: real worker processes, real gloo."""
from __future__ import annotations

import pytest

from shardserve import LLM, SamplingParams
from tests.tiny_models import make_tiny_checkpoint

PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 200, 100, 42] * 3, list(range(1, 10)), [300, 12, 7] * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 4 heads, 2 KV heads, 4 layers: TP 1/2/4 and PP 1/2/4 are all valid.
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama_pp")), "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(tiny, kv_cache_memory="16MiB", show_progress=False)
    try:
        return _tokens(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_tp_pp_layouts_match_single_device(tiny, reference, tp, pp):
    llm = LLM(tiny, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        assert _tokens(llm) == reference
        shapes = llm.engine.executor.collective_rpc("weight_shapes")
    finally:
        llm.engine.shutdown()
    # Weights are really sharded: each rank holds 1/TP of every sharded matrix, and only its stage's layers.
    full_qkv_rows = (4 + 2 * 2) * 24
    for rank, rank_shapes in enumerate(shapes):
        stage = rank // tp
        layers = {int(n.split(".")[2]) for n in rank_shapes if n.startswith("model.layers.")}
        assert layers == set(range(stage * 4 // pp, (stage + 1) * 4 // pp))
        first = min(layers)
        assert rank_shapes[f"model.layers.{first}.self_attn.qkv_proj.weight"] == (full_qkv_rows // tp, 96)
        assert rank_shapes[f"model.layers.{first}.self_attn.o_proj.weight"] == (96, 96 // tp)
        assert rank_shapes[f"model.layers.{first}.mlp.gate_up_proj.weight"] == (2 * 192 // tp, 96)
        assert ("lm_head.weight" in rank_shapes) == (stage == pp - 1)
        assert ("model.embed_tokens.weight" in rank_shapes) == (stage == 0)


def test_explicit_pipeline_partition(tiny, reference):
    llm = LLM(tiny, kv_cache_memory="16MiB", show_progress=False, pipeline_parallel_size=2, pp_layer_partition=[3, 1])
    try:
        assert _tokens(llm) == reference
        shapes = llm.engine.executor.collective_rpc("weight_shapes")
    finally:
        llm.engine.shutdown()
    assert {int(n.split(".")[2]) for n in shapes[1] if n.startswith("model.layers.")} == {3}


def test_data_parallel_replicas_share_the_load(tiny, reference):
    llm = LLM(tiny, kv_cache_memory="16MiB", show_progress=False, data_parallel_size=2)
    try:
        engine = llm.engine
        placed = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS * 2)]
        assert sorted(placed) == [0, 0, 0, 1, 1, 1]   # least loaded: alternates while both are idle
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert [done[f"r{i}"] for i in range(6)] == reference * 2
    finally:
        llm.engine.shutdown()


def test_bad_layouts_are_clear_errors(tiny):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*sizes that work: 1, 2, 4"):
        LLM(tiny, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="exceeds the model's 4 layers"):
        LLM(tiny, kv_cache_memory="16MiB", show_progress=False, pipeline_parallel_size=5)
    with pytest.raises(ValueError, match="partition"):
        LLM(tiny, kv_cache_memory="16MiB", show_progress=False, pipeline_parallel_size=2, pp_layer_partition=[2, 1])


def test_pipeline_keeps_one_batch_in_flight_per_stage(tiny, reference):
    """With PP=2 the engine runs two schedulers over disjoint halves of the KV pool and submits
    the second batch before the first comes back, so both stages work at once."""
    llm = LLM(tiny, kv_cache_memory="16MiB", show_progress=False, pipeline_parallel_size=2)
    engine = llm.engine
    try:
        assert len(engine.schedulers) == 2
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, GREEDY)
        assert all(sc.has_unfinished_requests() for sc in engine.schedulers)   # least-loaded placement
        engine.submit_step()
        assert len(engine.in_flight) == 2
        blocks = [{b for r in sched.scheduled_new_reqs for b in r.block_ids} for _, sched in engine.in_flight]
        assert not blocks[0] & blocks[1]                                        # disjoint KV slices
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.finish_step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            engine.submit_step()
        assert [done[f"r{i}"] for i in range(len(PROMPTS))] == reference
    finally:
        engine.shutdown()
