"""Speculative decoding through the engine: exact against no speculation (greedy tokens identical on
the batch-invariant CPU kernels) with n-gram and draft-model proposals, across continuous batching,
chunked prefill, prefix caching, preemption, stops, length limits, structured outputs and TP=2 over
real worker processes; with temperature the tokens follow the target's distribution."""
from __future__ import annotations

import json

import pytest

from shardserve import LLM, SamplingParams
from shardserve.sampling_params import StructuredOutputsParams
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# Repetitive prompts, so n-gram lookups find matches; one that never repeats.
PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 200, 100, 42] * 3, list(range(1, 40)), [300, 12, 7] * 9,
           [44, 45, 46, 44, 45, 46, 47], list(range(100, 170)) * 2]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("spec")
    target = make_tiny_checkpoint(str(root / "target"), "llama", num_hidden_layers=4)
    draft = make_tiny_checkpoint(str(root / "draft"), "llama", num_hidden_layers=1, seed=3)
    return target, draft


def _spec(kind: str, models: tuple[str, str]) -> dict | None:
    target, draft = models
    return {"none": None, "ngram": NGRAM, "draft": {"model": draft, "num_speculative_tokens": 3},
            "self": {"model": target, "num_speculative_tokens": 4}}[kind]


def make_llm(models, kind: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    return LLM(models[0], show_progress=False, speculative_config=_spec(kind, models), **kw)


def run(llm: LLM, params, prompts=PROMPTS) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             None if o.outputs[0].logprobs is None else [sorted(d) for d in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]


def mixed_params(stop_token: int | None = None) -> list[SamplingParams]:
    """Greedy requests of every kind; the ones with logprobs or penalties get no drafts but share
    the verification steps."""
    return [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0, max_tokens=20, min_tokens=4, ignore_eos=False,
                           stop_token_ids=[stop_token] if stop_token is not None else []),
            SamplingParams(temperature=0, max_tokens=18, repetition_penalty=1.2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]


@pytest.mark.parametrize("kind", ["ngram", "draft", "self"])
def test_tokens_match_no_speculation_with_chunked_prefill(models, kind):
    """Greedy requests, and seeded sampled ones (a row at output position p draws from (seed, p)
    whether it verifies a draft or not)."""
    base = make_llm(models, "none", max_num_batched_tokens=32)
    stop = run(base, mixed_params())[2][0][6]   # a token the min_tokens request meets after its minimum
    params = mixed_params(stop) + [SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24,
                                                  ignore_eos=True)]
    prompts = PROMPTS + PROMPTS[:1]
    reference = run(base, params, prompts)
    llm = make_llm(models, kind, max_num_batched_tokens=32)
    assert run(llm, params, prompts) == reference
    stats = llm.engine.stats()
    assert stats.spec_decoding.num_drafts > 0 and stats.kv_cache_usage == 0
    if kind != "draft":   # (an unrelated random draft model's proposals are all rejected)
        assert 0 < stats.spec_decoding.num_accepted_tokens < stats.spec_decoding.num_draft_tokens
    assert len(reference[4][0]) == 7 and reference[2][2] == "stop"   # length limit and stop token hit


def test_the_target_as_its_own_draft_has_every_draft_accepted(models):
    """Proves the draft's KV bookkeeping (catch-up over prefill chunks and accepted tokens, lookahead
    slots): the same weights propose exactly what greedy verification picks."""
    llm = make_llm(models, "self", max_num_batched_tokens=32)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    spec = llm.engine.stats().spec_decoding
    assert spec.num_draft_tokens > 100 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert spec.accepted_per_pos[0] == spec.num_drafts


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_preemption_and_prefix_hits_keep_tokens_exact(models, kind):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS + PROMPTS[:2]   # repeated prompts hit the prefix cache
    reference = run(make_llm(models, "none", max_model_len=160), params, prompts)   # one stops at the length
    # 14 blocks of 16 tokens cannot hold all seven requests: some are preempted and recomputed.
    llm = make_llm(models, kind, num_gpu_blocks_override=14, kv_cache_memory=None, max_model_len=160)
    assert run(llm, params, prompts) == reference
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.kv_cache_usage == 0


def test_stop_strings_end_the_text_where_they_would_without_drafts(models):
    """With every draft accepted (self-draft), a step adds five tokens: a stop string completed by
    one of the first four must cut the tokens after it too."""
    base = make_llm(models, "none")
    text = run(base, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), PROMPTS[:1])[0][1]
    stops = [text[i:i + 2] for i in range(3, len(text) - 2, max(1, len(text) // 7))]
    for kind in ("ngram", "self"):
        llm = make_llm(models, kind)
        for stop in stops:
            params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
            expected = run(base, params, PROMPTS[:1])
            assert run(llm, params, PROMPTS[:1]) == expected and expected[0][2] == "stop"


def test_structured_outputs_with_drafts_match_and_parse(models):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"]}
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    prompts = ['{"a": 1, "b": "xy"} {"a": 1, "b": "xy"} ', "name the numbers: "]
    reference = run(make_llm(models, "none"), params, prompts)
    for kind in ("ngram", "self"):
        llm = make_llm(models, kind)
        got = run(llm, params, prompts)
        assert got == reference
        assert llm.engine.stats().spec_decoding.num_draft_tokens > 0
    for tokens, text, finish, _ in reference:
        if finish == "stop":
            assert set(json.loads(text)) == {"a", "b"}


def test_sampled_tokens_follow_the_target_distribution(models):
    """Temperature 1 and top-k 4: the first token is drawn at the prefill (no drafts), the second by
    verifying the (self-)draft's proposal. The joint frequencies over 2000 seeded requests must
    match the target's own probabilities, read from logprobs, in every cell within 5 sigma."""
    import math
    prompt = PROMPTS[0]
    base = make_llm(models, "none")
    first = base.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=4), use_tqdm=False)
    p_first = _top4(first[0].outputs[0].logprobs[0])
    p_second = {}
    for t in p_first:
        out = base.generate([prompt + [t]], SamplingParams(temperature=0, max_tokens=1, logprobs=4), use_tqdm=False)
        p_second[t] = _top4(out[0].outputs[0].logprobs[0])
    llm = make_llm(models, "self", max_num_seqs=256)
    n = 2000
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=i) for i in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    spec = llm.engine.stats().spec_decoding
    assert spec.num_accepted_tokens > 200 and spec.num_draft_tokens - spec.num_accepted_tokens > 200
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    for t1, p1 in p_first.items():
        for t2, p2 in p_second[t1].items():
            p = p1 * p2
            sigma = max(1.0, math.sqrt(n * p * (1 - p)))
            assert abs(counts.get((t1, t2), 0) - n * p) <= 5 * sigma, (t1, t2, counts.get((t1, t2)), n * p)
    assert sum(counts.values()) == n and all(k[0] in p_first and k[1] in p_second[k[0]] for k in counts)


def _top4(logprobs: dict) -> dict[int, float]:
    """The distribution temperature 1 and top-k 4 sample from: the raw top 4, renormalised."""
    import math
    top = sorted(logprobs.items(), key=lambda kv: -kv[1].logprob)[:4]
    total = sum(math.exp(lp.logprob) for _, lp in top)
    return {t: math.exp(lp.logprob) / total for t, lp in top}


def test_seeded_sampling_with_drafts_repeats(models):
    llm = make_llm(models, "ngram")
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, seed=11)
    assert run(llm, params) == run(llm, params)


def test_tensor_parallel_workers_draft_alike(models):
    """TP=2 over worker processes: the driver samples and broadcasts the accepted tokens; both ranks
    run the (sharded) draft model and verify the same drafts."""
    params = mixed_params()
    results = []
    for kind in ("none", "ngram", "draft"):
        llm = make_llm(models, kind, tensor_parallel_size=2)   # TP sums differ from one device: compare TP=2
        try:
            results.append(run(llm, params))
            if kind != "none":
                assert llm.engine.stats().spec_decoding.num_drafts > 0
        finally:
            llm.engine.shutdown()
    assert results[1] == results[0] and results[2] == results[0]


def async_params() -> list[SamplingParams]:
    """Every kind of request, sampled ones too: async and sync scheduling must draw the same tokens
    (async holds a step back to propose, so drafts come at other steps than in sync)."""
    return mixed_params() + [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True, n=2),
        SamplingParams(temperature=0.7, seed=3, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5,
                       ignore_eos=True)]


@pytest.mark.parametrize("tp", [1, 2])
def test_ngram_drafts_under_async_scheduling_match_sync(models, tp):
    """With async scheduling a step is scheduled before the previous one's tokens are back; a
    request whose context matches holds the next step back so its drafts follow its last token.
    Steps mixing verification and scheduled-ahead decodes (whose input is the previous sample, on
    the device; penalties counting it) must give what synchronous steps give, sampled tokens too."""
    prompts = PROMPTS + [PROMPTS[1], PROMPTS[3]]
    results = []
    for async_scheduling in (False, True):
        llm = make_llm(models, "ngram", async_scheduling=async_scheduling, tensor_parallel_size=tp,
                       max_num_batched_tokens=48)
        try:
            results.append(run(llm, async_params(), prompts))
            spec = llm.engine.stats().spec_decoding
            assert spec.num_accepted_tokens > 0 and llm.engine.async_scheduling == async_scheduling
        finally:
            llm.engine.shutdown()
    assert results[1] == results[0]


def test_refused_configurations_say_why(models):
    with pytest.raises(ValueError, match="async_scheduling off"):
        make_llm(models, "draft", async_scheduling=True)
    with pytest.raises(ValueError, match="pipeline parallelism"):
        make_llm(models, "ngram", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(models[0], show_progress=False, speculative_config="{method: ngram")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(models[0], show_progress=False, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="unknown key"):
        LLM(models[0], show_progress=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                "lookahead": 3})
    with pytest.raises(ValueError, match="eagle"):
        LLM(models[0], show_progress=False, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
