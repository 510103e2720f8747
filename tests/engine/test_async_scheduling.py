"""Async scheduling (step N+1 scheduled while step N runs, its decode inputs taken from the device)
gives exactly the tokens of the synchronous engine: greedy and seeded sampling, penalties,
min_tokens, stop tokens and strings, logprobs, n > 1, chunked prefill, preemption, aborts, and TP=2
over real worker processes. On the CPU a step runs at launch, so nothing overlaps here, but every
piece of the bookkeeping (placeholders, late stops, the one extra token) is exercised as on a GPU."""
from __future__ import annotations

import pytest

from shardserve import LLM, SamplingParams
from shardserve.kernels.cpu import cpu_ops
from tests.tiny_models import make_tiny_checkpoint

PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 200, 100, 42] * 3, list(range(1, 10)), [300, 12, 7] * 9,
           [44, 45, 46], list(range(100, 170))]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_async")), "llama", num_hidden_layers=4)


def make_llm(path: str, async_scheduling: bool, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    return LLM(path, show_progress=False, async_scheduling=async_scheduling, **kw)


def outputs(llm: LLM, params, prompts=PROMPTS) -> list[list[tuple]]:
    """Per request, per sample: everything a user sees. The native CPU kernels are batch invariant,
    so even the logprob values must match exactly; torch's own (SHARDSERVE_CPU_KERNELS=0) vary
    in the last bits with the step's batch, so there they are compared to 4 decimals."""
    exact = cpu_ops.available()
    result = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        prompt_lps = None if out.prompt_logprobs is None else [None if d is None else sorted(d.items())
                                                                for d in out.prompt_logprobs]
        result.append([(s.token_ids, s.text, s.finish_reason,
                        [sorted(d.items()) for d in s.logprobs] if s.logprobs is not None else None, prompt_lps)
                       for s in out.outputs])
    return result if exact else _rounded(result)


def _rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, (list, tuple)):
        return type(value)(_rounded(v) for v in value)
    if hasattr(value, "logprob"):   # Logprob: its value rounded, rank and text as they are
        return (round(value.logprob, 4), value.rank, value.decoded_token)
    return value


def mixed_params(stop_token: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True, n=2),
            SamplingParams(temperature=0.7, seed=3, max_tokens=12, repetition_penalty=1.3,
                           frequency_penalty=0.5, presence_penalty=0.2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=20, min_tokens=4, ignore_eos=False,
                           stop_token_ids=[stop_token] if stop_token is not None else []),
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)]


def in_flight_depth(llm: LLM) -> list[int]:
    """Records how many steps were in flight each time one was submitted."""
    engine, depths = llm.engine, []
    submit = engine.executor.submit_execute

    def recording(sched):
        depths.append(len(engine.in_flight) + 1)
        return submit(sched)
    engine.executor.submit_execute = recording
    return depths


def test_async_matches_sync_on_a_mixed_batch_with_chunked_prefill(tiny):
    sync = make_llm(tiny, False, max_num_batched_tokens=32)
    reference = outputs(sync, mixed_params())
    # A stop token the greedy request meets after its min_tokens: it must stop there in both modes.
    stop = reference[0][0][0][6]
    reference = outputs(sync, mixed_params(stop))
    llm = make_llm(tiny, True, max_num_batched_tokens=32)
    assert llm.engine.async_scheduling
    depths = in_flight_depth(llm)
    got = outputs(llm, mixed_params(stop))
    assert got == reference
    assert reference[4][0][4] is not None and reference[0][0][3] is not None   # both kinds of logprobs compared
    assert max(depths) == 2   # the next step really was scheduled before the previous one returned
    assert llm.engine.scheduler.kv.usage() == 0


def test_stop_strings_and_eos_stop_at_the_same_token(tiny):
    sync, llm = make_llm(tiny, False), make_llm(tiny, True)
    text = outputs(sync, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), PROMPTS[:1])[0][0][1]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    assert outputs(llm, params) == outputs(sync, params)
    assert outputs(llm, params)[0][0][2] == "stop"


def test_preemption_under_async_scheduling_gives_the_same_tokens(tiny):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = outputs(make_llm(tiny, False), params)
    # 12 blocks of 16 tokens cannot hold all five requests' 50-110 tokens: some are preempted.
    llm = make_llm(tiny, True, num_gpu_blocks_override=12, kv_cache_memory=None, max_model_len=128)
    assert outputs(llm, params) == reference
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.scheduler.kv.usage() == 0


def test_abort_while_two_steps_are_in_flight_frees_everything(tiny):
    llm = make_llm(tiny, True)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(engine.in_flight) == 1   # one more already submitted behind what step() returned
    engine.abort_request(["1", "3"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["0", "2", "4"]
    assert all(len(o.outputs[0].token_ids) == 50 for o in finished.values())
    assert engine.scheduler.kv.usage() == 0 and not engine.in_flight


def test_async_scheduling_is_refused_with_pipeline_stages(tiny):
    with pytest.raises(ValueError, match="async_scheduling needs pipeline_parallel_size=1"):
        make_llm(tiny, True, pipeline_parallel_size=2)


def test_tensor_parallel_workers_share_the_sampled_tokens(tiny):
    """TP=2 over worker processes: only rank 0 samples, so rank 1 gets the tokens it must embed
    next by broadcast, and results come back through the workers' reply threads."""
    params = mixed_params()
    results = []
    for async_scheduling in (False, True):   # TP sums in another order than one device: compare TP with TP
        llm = make_llm(tiny, async_scheduling, tensor_parallel_size=2)
        try:
            results.append(outputs(llm, params))
        finally:
            llm.engine.shutdown()
    assert results[1] == results[0]
