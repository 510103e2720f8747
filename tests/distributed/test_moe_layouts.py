"""Mixture-of-experts layouts give the single-device greedy tokens: experts sliced over TP, whole
experts over the expert-parallel group, with pipeline stages and data-parallel replicas. Real
worker processes, real gloo."""
from __future__ import annotations

import pytest

from shardserve import LLM, SamplingParams
from tests.tiny_models import make_tiny_checkpoint

PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 200, 100, 42] * 3, list(range(1, 10)), [300, 12, 7] * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
HIDDEN, EXPERTS, EXPERT_WIDTH = 96, 8, 64


def _tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _single_device(path: str) -> list[list[int]]:
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False)
    try:
        return _tokens(llm)
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    # 4 layers (layer 1 dense), 8 experts, top-2, 4 heads / 2 KV heads.
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3_moe")), "qwen3_moe", num_hidden_layers=4)
    return path, _single_device(path)


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, False), (2, 1, True), (2, 2, True)])
def test_qwen3_moe_layouts_match_single_device(qwen3_moe, tp, pp, ep):
    path, reference = qwen3_moe
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, enable_expert_parallel=ep)
    try:
        assert _tokens(llm) == reference
        shapes = llm.engine.executor.collective_rpc("weight_shapes")
    finally:
        llm.engine.shutdown()
    # Experts really are split: whole experts over EP, or every expert's width over TP.
    experts, width = (EXPERTS // tp, EXPERT_WIDTH) if ep else (EXPERTS, EXPERT_WIDTH // tp)
    for rank_shapes in shapes:
        sparse = sorted(n for n in rank_shapes if n.endswith("mlp.experts.w13_weight"))
        assert sparse, "every stage of this model holds sparse layers"
        assert rank_shapes[sparse[0]] == (experts, 2 * width, HIDDEN)
        assert rank_shapes[sparse[0].replace("w13", "w2")] == (experts, HIDDEN, width)
        assert rank_shapes[sparse[0].replace("experts.w13_weight", "gate.weight")] == (EXPERTS, HIDDEN)


@pytest.mark.parametrize("arch,ep", [("mixtral", True), ("olmoe", False)])
def test_mixtral_and_olmoe_under_tensor_parallelism(tmp_path, arch, ep):
    """Mixtral's checkpoint names with expert parallelism; OLMoE's q/k norm spanning all heads, which
    TP splits across ranks (and its KV heads, 2 for TP=2)."""
    path = make_tiny_checkpoint(str(tmp_path / arch), arch)
    reference = _single_device(path)
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=2, enable_expert_parallel=ep)
    try:
        assert _tokens(llm) == reference
    finally:
        llm.engine.shutdown()


def test_bad_moe_layouts_name_the_valid_sizes(qwen3_moe, tmp_path):
    path, _ = qwen3_moe
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts model"):
        LLM(make_tiny_checkpoint(str(tmp_path / "dense"), "llama"), enable_expert_parallel=True)
    # 8 experts over 3 ranks (and 4 heads over 3): refused before any process starts, with the sizes that work.
    with pytest.raises(ValueError, match="sizes that work: 1, 2, 4"):
        LLM(path, tensor_parallel_size=3, enable_expert_parallel=True)


def test_data_parallel_expert_parallel_matches_single_device(qwen3_moe):
    """DP=2 x EP: the replicas' ranks form one EP group of 2, each holding 4 whole experts; every MoE
    layer exchanges the replicas' tokens. Uneven load on purpose: replica 1 gets the request that
    stops after 4 tokens, then steps idle for 8 steps while replica 0 still needs its experts (a
    replica that skipped those exchanges would leave the other waiting: the timeout fails the test)."""
    path, reference = qwen3_moe
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False, data_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout_s=30)
    lengths = [12, 4, 8]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [ref[:n] for ref, n in zip(reference, lengths)]
        assert _tokens(llm) == reference
        shapes = [replica.executor.collective_rpc("weight_shapes") for replica in llm.engine.replicas]
    finally:
        llm.engine.shutdown()
    for (rank_shapes,) in shapes:
        assert rank_shapes["model.layers.0.mlp.experts.w13_weight"] == (EXPERTS // 2, 2 * EXPERT_WIDTH, HIDDEN)
