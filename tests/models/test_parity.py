"""Logit parity with HF transformers, through the real engine path (scheduler, paged KV cache,
sampler), on tiny random-weight checkpoints of every supported architecture, in fp32.

Our log-probs come from `prompt_logprobs=-1` / `logprobs=-1` (the whole vocabulary); HF's from a
plain forward pass over prompt + generated tokens. Greedy tokens are checked against HF `generate`.
The engine-level properties that must not change results (chunked prefill, batching, prefix-cache
hits, preemption and recompute) are checked against the same references.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams
from tests.tiny_models import TINY_CONFIGS, assert_serves_bf16_values, load_hf_model, make_tiny_checkpoint

TOL = 1e-4          # max abs diff of log-probs, fp32
VOCAB = 320         # tiny_models' vocab_size
PROMPT_LEN = 40     # > 2 blocks of 16, and > the sliding window of 8
MAX_TOKENS = 8

# Every architecture in tests/tiny_models.py, plus the variants that switch on a code path.
VARIANTS: dict[str, tuple[str, dict]] = {arch: (arch, {}) for arch in TINY_CONFIGS}
VARIANTS["llama-mha"] = ("llama", {"num_key_value_heads": 4})        # MHA: kv heads == heads
VARIANTS["mistral-sw8"] = ("mistral", {"sliding_window": 8})         # window shorter than the prompt


def full_logprob_params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=-1, logprobs=-1)


def random_prompt(seed: int, length: int, vocab: int = VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] log-probs of the next token at every position."""
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(dim=-1)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          eos_token_id=None, pad_token_id=0)   # like ignore_eos: never stop early
    return out[0, len(prompt):].tolist()


def logprob_matrix(rows) -> torch.Tensor:
    """Our per-position {token_id: Logprob} dicts as a [positions, vocab] tensor."""
    for row in rows:
        assert row is not None and len(row) == VOCAB, "logprobs=-1 must return the whole vocabulary"
    return torch.tensor([[row[t].logprob for t in range(VOCAB)] for row in rows])


def assert_matches_hf(out, hf, prompt: list[int], max_tokens: int = MAX_TOKENS) -> None:
    """Prompt log-probs, greedy tokens and decode log-probs of one RequestOutput against HF."""
    gen = out.outputs[0].token_ids
    assert out.prompt_token_ids == prompt
    assert gen == hf_greedy(hf, prompt, max_tokens), "greedy tokens differ from HF generate"
    ref = hf_logprobs(hf, prompt + gen)

    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    ours = logprob_matrix(out.prompt_logprobs[1:])
    # Position i of the prompt is predicted by HF's row i - 1.
    diff = (ours - ref[:len(prompt) - 1]).abs().max().item()
    assert diff <= TOL, f"prompt log-probs differ from HF by {diff:.2e}"
    for i, row in enumerate(out.prompt_logprobs[1:], start=1):
        assert prompt[i] in row

    assert out.outputs[0].logprobs is not None and len(out.outputs[0].logprobs) == len(gen)
    ours = logprob_matrix(out.outputs[0].logprobs)
    diff = (ours - ref[len(prompt) - 1:len(prompt) - 1 + len(gen)]).abs().max().item()
    assert diff <= TOL, f"decode log-probs differ from HF by {diff:.2e}"
    for row, tok in zip(out.outputs[0].logprobs, gen):
        assert row[tok].rank == 1, "a greedy token must be the rank-1 token"
    expected_cum = sum(row[tok].logprob for row, tok in zip(out.outputs[0].logprobs, gen))
    assert out.outputs[0].cumulative_logprob == pytest.approx(expected_cum, abs=1e-4)


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp(request.param)), arch, **overrides)
    hf = load_hf_model(path)
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    yield SimpleNamespace(name=request.param, path=path, hf=hf, llm=llm)
    llm.engine.shutdown()


def test_config_shapes(tiny):
    """The variants really cover GQA, MHA and the sliding window they are named for."""
    mc = tiny.llm.engine.config.model_config
    assert mc.dtype == torch.float32
    assert mc.num_kv_heads == tiny.hf.config.num_key_value_heads
    if tiny.name == "llama-mha":
        assert mc.num_kv_heads == mc.num_heads
    else:
        assert mc.num_kv_heads < mc.num_heads
    layers = tiny.llm.engine.executor.worker.model_runner.model.attention_layers()
    expected_window = 8 if tiny.name == "mistral-sw8" else None
    assert [layer.spec.sliding_window for layer in layers] == [expected_window] * len(layers)


def test_logprobs_and_greedy_match_hf(tiny):
    prompt = random_prompt(1, PROMPT_LEN)
    out = tiny.llm.generate([prompt], full_logprob_params())[0]
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert_matches_hf(out, tiny.hf, prompt)


def test_short_prompt_matches_hf(tiny):
    """A prompt inside one block, with generation crossing into the next block."""
    prompt = random_prompt(2, 11)
    out = tiny.llm.generate([prompt], full_logprob_params(max_tokens=9))[0]
    assert_matches_hf(out, tiny.hf, prompt, max_tokens=9)


def test_chunked_prefill_matches_hf(tiny):
    llm = LLM(tiny.path, kv_cache_memory="16MiB", max_num_batched_tokens=16, show_progress=False, max_logprobs=-1)
    scheduled: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        sched = schedule()
        scheduled.append(sum(sched.num_scheduled_tokens.values()))
        return sched

    llm.engine.scheduler.schedule = recording_schedule
    prompt = random_prompt(1, PROMPT_LEN)
    out = llm.generate([prompt], full_logprob_params())[0]
    # 40 prompt tokens in chunks of 16, 16, 8 (the last chunk samples token 1), then 7 decodes.
    assert scheduled == [16, 16, 8] + [1] * (MAX_TOKENS - 1)
    assert_matches_hf(out, tiny.hf, prompt)

    # Without prompt log-probs the prefix cache takes part: a fresh prompt is looked up, then
    # prefilled in chunks; the same prompt again starts from its cached blocks.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=-1)
    other = random_prompt(9, PROMPT_LEN)
    scheduled.clear()
    first = llm.generate([other], params)[0]
    assert scheduled[:3] == [16, 16, 8] and first.num_cached_tokens == 0
    second = llm.generate([other], params)[0]
    assert second.num_cached_tokens == 32
    ref = hf_logprobs(tiny.hf, other + first.outputs[0].token_ids)[PROMPT_LEN - 1:-1]
    for res in (first, second):
        assert res.outputs[0].token_ids == hf_greedy(tiny.hf, other, MAX_TOKENS)
        diff = (logprob_matrix(res.outputs[0].logprobs) - ref).abs().max().item()
        assert diff <= TOL, f"decode log-probs differ from HF by {diff:.2e}"
    llm.engine.shutdown()


def test_unwritten_kv_slots_are_never_read(tiny):
    """A reused block may hold anything a previous owner (or a broken model) left, NaN included.
    Poison every slot but the null block's; chunked prefills and batched decodes of different
    lengths must still match HF exactly (masked slots must not leak, not even as 0 * NaN)."""
    llm = LLM(tiny.path, kv_cache_memory="16MiB", max_num_batched_tokens=16, show_progress=False, max_logprobs=-1)
    runner = llm.engine.executor.worker.model_runner
    for cache in runner.kv_caches:
        cache.fill_(float("nan"))
        runner.backend.zero_blocks(cache, torch.tensor([0]))
    prompts = [random_prompt(31, PROMPT_LEN), random_prompt(32, 23)]
    outs = llm.generate(prompts, full_logprob_params())
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(out, tiny.hf, prompt)
    llm.engine.shutdown()


def test_fresh_blocks_are_zeroed_in_every_layer_at_once(tiny):
    """All layers' caches are views of one pool, so a step zeroes its fresh blocks with one launch:
    the block goes to zero in every layer, K and V, and no other block changes."""
    llm = LLM(tiny.path, kv_cache_memory="16MiB", show_progress=False)
    runner = llm.engine.executor.worker.model_runner
    assert len(runner.kv_pools) == 1 and len(runner.kv_caches) == tiny.hf.config.num_hidden_layers
    pool = runner.kv_pools[0]
    assert all(c.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr() for c in runner.kv_caches)
    for i, cache in enumerate(runner.kv_caches):
        cache.copy_(torch.rand_like(cache) + i + 1)
    before = [c.clone() for c in runner.kv_caches]
    runner.backend.zero_blocks(pool, torch.tensor([3, 5]))
    for cache, old in zip(runner.kv_caches, before):
        assert cache[:, :, [3, 5]].eq(0).all()
        keep = [b for b in range(cache.shape[2]) if b not in (3, 5)]
        assert torch.equal(cache[:, :, keep], old[:, :, keep])
    llm.engine.shutdown()


def test_sliding_window_changes_hf_logits(tmp_path):
    """Guard for the mistral-sw8 parity cases: HF really applies the window of 8 on a 40-token
    prompt, so matching it is not the same as matching full attention."""
    path = make_tiny_checkpoint(str(tmp_path / "sw"), "mistral", sliding_window=8)
    windowed = load_hf_model(path)
    full = load_hf_model(path)
    full.config.sliding_window = None
    for layer in full.model.layers:
        layer.self_attn.sliding_window = None
    prompt = random_prompt(1, PROMPT_LEN)
    a, b = hf_logprobs(windowed, prompt), hf_logprobs(full, prompt)
    assert (a[:8] - b[:8]).abs().max() <= TOL          # inside the window: identical
    assert (a[8:] - b[8:]).abs().max() > 1e-2          # beyond it: different


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_bf16_checkpoint_loads_as_bf16(tmp_path, arch):
    path = make_tiny_checkpoint(str(tmp_path / "bf16"), arch, dtype=torch.bfloat16)
    llm = LLM(path, dtype="auto", kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    mc = llm.engine.config.model_config
    assert mc.dtype == torch.bfloat16
    assert_serves_bf16_values(llm)
    # Same weights in fp32 on the HF side: bf16 activations stay close, not bit-equal.
    hf = load_hf_model(path, dtype=torch.float32)
    prompt = random_prompt(3, 24)
    out = llm.generate([prompt], full_logprob_params(max_tokens=1))[0]
    ours = logprob_matrix(out.prompt_logprobs[1:])
    diff = (ours - hf_logprobs(hf, prompt)[:len(prompt) - 1]).abs().max().item()
    assert diff < 0.1, f"bf16 prompt log-probs are {diff:.3f} away from the fp32 reference"
    llm.engine.shutdown()


# ---- engine behaviours that must not change results (llama, GQA) -----------------------------

def _checkpoint(tmp_path_factory, variant: str) -> SimpleNamespace:
    arch, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp(variant)), arch, **overrides)
    return SimpleNamespace(path=path, hf=load_hf_model(path))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "llama")


@pytest.fixture(scope="module", params=["llama", "mistral-sw8"])
def batch_ckpt(request, tmp_path_factory):
    return _checkpoint(tmp_path_factory, request.param)


def test_batch_invariance(batch_ckpt):
    """A request's greedy tokens do not depend on what else is in the batch (decodes of different
    lengths padded together, prefill chunks beside decodes; with and without a sliding window)."""
    llama = batch_ckpt
    llm = LLM(llama.path, kv_cache_memory="16MiB", enable_prefix_caching=False, show_progress=False, max_logprobs=-1)
    target = random_prompt(7, 37)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    alone = llm.generate([target], params)[0]
    rng = random.Random(11)
    others = [random_prompt(100 + i, rng.randrange(3, 90)) for i in range(32)]
    other_params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 24), ignore_eos=True)
                    for _ in others]   # different lengths: the batch changes shape while the target runs
    prompts = others[:16] + [target] + others[16:]
    params_list = other_params[:16] + [params] + other_params[16:]
    outs = llm.generate(prompts, params_list)
    batched = outs[16]
    assert batched.prompt_token_ids == target
    assert batched.outputs[0].token_ids == alone.outputs[0].token_ids
    assert alone.outputs[0].token_ids == hf_greedy(llama.hf, target, 16)
    for a, b in zip(alone.outputs[0].logprobs, batched.outputs[0].logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) <= TOL
    for out, p, sp in zip(outs, prompts, params_list):
        assert out.prompt_token_ids == p and len(out.outputs[0].token_ids) == sp.max_tokens
    llm.engine.shutdown()


def test_prefix_cache_hits_give_identical_tokens(llama):
    llm = LLM(llama.path, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    prompt = random_prompt(21, 70)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    first = llm.generate([prompt], params)[0]
    hits_before = llm.engine.stats().prefix_cache_hits
    second = llm.generate([prompt], params)[0]
    hits_after = llm.engine.stats().prefix_cache_hits
    assert first.num_cached_tokens == 0
    assert hits_after > hits_before
    # Whole blocks only, and the last prompt token is always recomputed: 4 blocks of 16 = 64.
    assert second.num_cached_tokens == 64
    assert hits_after - hits_before == 64
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(llama.hf, prompt, 12)
    for a, b in zip(first.outputs[0].logprobs, second.outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) <= TOL for t in a)

    # A prompt that shares only the first 3 blocks hits exactly those, then diverges correctly.
    branch = prompt[:48] + random_prompt(22, 30)
    out = llm.generate([branch], params)[0]
    assert out.num_cached_tokens == 48
    assert out.outputs[0].token_ids == hf_greedy(llama.hf, branch, 12)
    llm.engine.shutdown()


def test_preemption_and_resume_give_same_tokens(llama):
    # 81 blocks (80 usable, 1280 tokens): each request alone fits, 8 of them growing to
    # ~200 tokens (13 blocks each) do not.
    probe = LLM(llama.path, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    per_block = probe.engine.executor.kv_bytes_per_block()
    llm = LLM(llama.path, kv_cache_memory=81 * per_block, max_model_len=256, show_progress=False, max_logprobs=-1)
    rng = random.Random(5)
    prompts = [random_prompt(200 + i, rng.randrange(60, 100)) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=110, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert llm.engine.stats().num_preemptions == llm.engine.scheduler.num_preemptions
    assert llm.engine.scheduler.kv.num_free_blocks == 80, "all blocks come back after the run"
    for prompt, out in zip(prompts, outs):
        alone = probe.generate([prompt], params)[0]
        assert len(out.outputs[0].token_ids) == 110
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        # Recomputing a preempted request must not duplicate or shift its log-probs.
        for ours, ref in ((out.prompt_logprobs, alone.prompt_logprobs), (out.outputs[0].logprobs,
                                                                         alone.outputs[0].logprobs)):
            assert len(ours) == len(ref)
            for a, b in zip(ours, ref):
                if a is None or b is None:
                    assert a is b
                    continue
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) <= TOL for t in a)
    # And one of them against HF, end to end.
    assert outs[0].outputs[0].token_ids == hf_greedy(llama.hf, prompts[0], 110)
    probe.engine.shutdown()
    llm.engine.shutdown()
