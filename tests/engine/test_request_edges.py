"""Edge cases at the engine's door: stop-token text, bad stop ids, request-id reuse, n > 1 ids, and a
GPU-only probe asked of a CPU engine."""
from __future__ import annotations

import pytest

from shardserve import LLM, SamplingParams
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_edges")), "llama")
    engine = LLM(path, kv_cache_memory="16MiB", show_progress=False)
    yield engine
    engine.engine.shutdown()


def test_stop_token_ends_text_without_appearing_in_it(llm):
    prompt = [5, 17, 99, 3, 250]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    tokens = free.outputs[0].token_ids
    stop = tokens[2]
    first = tokens.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert out.token_ids == tokens[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == tok.decode(tokens[:first])
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == tok.decode(tokens[:first + 1])


def test_stop_token_outside_vocabulary_is_rejected_and_engine_survives(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2, 3]], SamplingParams(min_tokens=1, max_tokens=3, stop_token_ids=[10**7]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_top_k_past_the_vocabulary_keeps_it_all(llm):
    """A top_k larger than the vocabulary (even past int64, as a fuzzer sent) filters nothing,
    instead of failing the step and with it the engine."""
    def tokens(top_k: int) -> list[int]:
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=3, max_tokens=4, ignore_eos=True)
        return llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens(2**70) == tokens(10**6) == tokens(0)


def test_request_ids_cannot_collide(llm):
    engine = llm.engine
    engine.add_request("x", [1, 2, 3], SamplingParams(n=2, max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2))
    engine.add_request("0_x", [4, 5, 6], SamplingParams(max_tokens=2))   # the old child-id spelling is free
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert len(done["x"].outputs) == 2 and len(done["0_x"].outputs) == 1
    assert engine.stats().kv_cache_usage == 0.0


def test_logprobs_are_capped_by_max_logprobs(llm):
    with pytest.raises(ValueError, match="logprobs=21 exceeds this engine's max_logprobs=20"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs=-1 exceeds"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, prompt_logprobs=-1), use_tqdm=False)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)[0].outputs[0]
    assert all(20 <= len(row) <= 21 for row in out.logprobs)


def test_prefix_cache_hash_is_sha256_by_default_and_chained():
    from shardserve.config import CacheConfig, SchedulerConfig
    from shardserve.engine.kv_cache import builtin_block_hash, sha256_block_hash
    from shardserve.engine.scheduler import Scheduler
    assert Scheduler(SchedulerConfig(), CacheConfig(), 8).kv.hash_fn is sha256_block_hash
    assert Scheduler(SchedulerConfig(), CacheConfig(prefix_caching_hash_algo="builtin"), 8).kv.hash_fn \
        is builtin_block_hash
    a = sha256_block_hash(None, (1, 2, 3))
    assert a == sha256_block_hash(None, (1, 2, 3)) and 0 <= a < 2**128
    assert sha256_block_hash(a, (4, 5)) != sha256_block_hash(None, (4, 5))   # the parent is part of it
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        CacheConfig(prefix_caching_hash_algo="md5")


def test_without_tokenizer_eos_comes_from_the_config(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "noeos"), "llama")
    engine = LLM(path, kv_cache_memory="16MiB", show_progress=False, skip_tokenizer_init=True).engine
    try:
        from tests.tiny_models import EOS_ID
        assert engine.eos_token_ids == frozenset({EOS_ID})
    finally:
        engine.shutdown()


def test_decode_graph_profile_on_cpu_says_why_it_cannot(llm):
    """benchmarks/graph_replay_time.py's per-rank probe: a CPU engine has no graphs to replay."""
    with pytest.raises(RuntimeError, match="no decode graphs"):
        llm.engine.executor.collective_rpc("profile_decode_graph", (1,))
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("value,tp,want", [(None, 1, True), (None, 2, True), ("1", 2, True), ("0", 1, False),
                                           ("0", 2, False), ("off", 1, False), ("false", 1, False), ("", 1, False)])
def test_prefill_and_piecewise_graph_switches_resolve_once_in_the_config(tmp_path, monkeypatch, value, tp, want):
    """SHARDSERVE_PREFILL_GRAPHS / SHARDSERVE_PIECEWISE_GRAPHS are read by the engine and shipped to
    the workers in the config (ranks must agree on which steps replay graphs). Unset: on, with TP too."""
    from shardserve.engine.args import EngineArgs
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", num_attention_heads=4, num_key_value_heads=2)
    for env in ("SHARDSERVE_PREFILL_GRAPHS", "SHARDSERVE_PIECEWISE_GRAPHS"):
        if value is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, value)
    mc = EngineArgs(model=path, tensor_parallel_size=tp, device="cpu").create_engine_config().model_config
    assert mc.prefill_graphs is want and mc.piecewise_graphs is want


@pytest.mark.parametrize("gb,message", [(2.0, "streams weights from CPU memory to a GPU"), (-1.0, "0 or more")])
def test_cpu_offload_is_refused_where_it_cannot_mean_anything(tmp_path, gb, message):
    """--cpu-offload-gb moves weights between CPU and GPU memory: a CPU run (where every weight is in
    CPU memory) and a negative size are clear errors. Its streaming is tested on a GPU
    (tests/gpu/test_cuda_cpu_offload.py)."""
    from shardserve.engine.args import EngineArgs
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=path, device="cpu", cpu_offload_gb=gb).create_engine_config()
    assert EngineArgs(model=path, device="cpu").create_engine_config().model_config.cpu_offload_gb == 0


def test_cpu_offload_flag_reaches_the_engine_config():
    from shardserve.cli import build_parser, engine_args_from
    ns = build_parser().parse_args(["serve", "--cpu-offload-gb", "1.5"])
    assert engine_args_from(ns).cpu_offload_gb == 1.5


def test_final_only_requests_yield_one_output_and_generate_leaves_params_alone(llm):
    """output_kind FINAL_ONLY (what LLM.generate asks for): no output until the request finishes,
    then the same output CUMULATIVE ends with; the caller's SamplingParams keep their kind."""
    from shardserve.sampling_params import RequestOutputKind
    engine = llm.engine
    prompt = [5, 17, 99, 3, 250]
    seen = {}
    for kind in RequestOutputKind:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2, seed=3, output_kind=kind)
        engine.add_request(kind.name, prompt, params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        seen[kind] = outs
    assert len(seen[RequestOutputKind.CUMULATIVE]) >= 5
    assert len(seen[RequestOutputKind.FINAL_ONLY]) == 1 and seen[RequestOutputKind.FINAL_ONLY][0].finished
    final, cumulative = seen[RequestOutputKind.FINAL_ONLY][0], seen[RequestOutputKind.CUMULATIVE][-1]
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in cumulative.outputs]
    assert [c.text for c in final.outputs] == [c.text for c in cumulative.outputs]
    params = SamplingParams(temperature=0, max_tokens=3)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == final.outputs[0].token_ids[:3]
    assert params.output_kind == RequestOutputKind.CUMULATIVE


def test_priority_needs_the_priority_policy_and_leaves_nothing_behind(llm):
    with pytest.raises(ValueError, match="--scheduling-policy priority") as err:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    assert err.value.param == "priority"
    assert not llm.engine.has_unfinished_requests() and not llm.engine.output_processor.requests
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])


def test_priority_policy_serves_the_most_urgent_first(tmp_path):
    """One sequence at a time: requests finish in priority order, ties in arrival order, whatever
    order they came in; LLM.generate still returns its outputs in the prompts' order."""
    path = make_tiny_checkpoint(str(tmp_path), "llama")
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False, max_num_seqs=1, scheduling_policy="priority")
    try:
        engine = llm.engine
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        for rid, priority in [("background", 10), ("normal-1", 0), ("urgent", -5), ("normal-2", 0)]:
            engine.add_request(rid, [7, 8, 9], params, priority=priority)
        finished = []
        while engine.has_unfinished_requests():
            finished += [out.request_id for out in engine.step() if out.finished]
        assert finished == ["urgent", "normal-1", "normal-2", "background"]
        outs = llm.generate([[1, 2, 3], [4, 5, 6]], params, use_tqdm=False, priority=[3, -3])
        assert [out.prompt_token_ids for out in outs] == [[1, 2, 3], [4, 5, 6]]
    finally:
        llm.engine.shutdown()


def test_priority_order_changes_no_greedy_tokens(llm, tmp_path):
    """Urgent requests arriving mid-decode go ahead of running ones in the batch, and a tight KV
    pool preempts the least urgent: every request still gets the greedy tokens it gets alone."""
    path = make_tiny_checkpoint(str(tmp_path), "llama")
    urgent = LLM(path, show_progress=False, max_num_seqs=4, block_size=16, max_model_len=64,
                 num_gpu_blocks_override=9, scheduling_policy="priority")   # 8 blocks: room for ~2.5 requests
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        prompts = {f"r{i}": [(7 * i + j) % 250 + 3 for j in range(5 + 3 * i)] for i in range(8)}
        want = {rid: out.outputs[0].token_ids for rid, out in
                zip(prompts, llm.generate(list(prompts.values()), params, use_tqdm=False))}
        engine, got, pending = urgent.engine, {}, list(prompts.items())
        while pending or engine.has_unfinished_requests():
            if pending:   # two more each step, alternately less and more urgent than those before
                for rid, prompt in pending[:2]:
                    engine.add_request(rid, prompt, params, priority=-int(rid[1:]) if int(rid[1:]) % 2 else 5)
                pending = pending[2:]
            got.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
        assert got == want
        assert sum(s.num_preemptions for s in engine.schedulers) > 0, "the pool was meant to run dry"
    finally:
        urgent.engine.shutdown()


def test_chat_hands_tools_to_the_template(llm):
    template = ("{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "weather?"}]
    params = SamplingParams(max_tokens=1)
    with_tools = llm.chat(messages, params, chat_template=template, tools=tools, use_tqdm=False)[0]
    assert with_tools.prompt == "TOOLS: get_weather\nuser: weather?\nassistant:"
    assert llm.chat(messages, params, chat_template=template, use_tqdm=False)[0].prompt == "user: weather?\nassistant:"
