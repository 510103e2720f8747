"""Sampling semantics end to end on a tiny random model (seeds, n, greedy, top-k/p, penalties,
min_tokens, eos, stop tokens, logprobs). The Sampler's exact arithmetic is tests/layers/test_sampler.py."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from shardserve import LLM, SamplingParams
from tests.tiny_models import EOS_ID, make_tiny_checkpoint

PROMPT = {"prompt_token_ids": [1, 2, 3, 4, 5]}
OTHER = {"prompt_token_ids": [40, 41, 42, 43, 44, 45, 46, 47, 48]}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return LLM(model_path, kv_cache_memory="16MiB", show_progress=False)


def gen(llm: LLM, prompts, **params) -> list:
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def tokens(llm: LLM, prompt=PROMPT, **params) -> list[int]:
    params.setdefault("ignore_eos", True)
    return gen(llm, prompt, **params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def greedy(llm) -> list[int]:
    return tokens(llm, temperature=0.0, max_tokens=16)


def num_repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


# ---- seeds ---------------------------------------------------------------------------------
def test_seeded_request_is_reproducible_and_independent_of_batch(llm, model_path):
    params = dict(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = gen(llm, PROMPT, **params)[0].outputs[0].token_ids
    assert len(alone) == 12
    assert gen(llm, PROMPT, **params)[0].outputs[0].token_ids == alone
    batch = llm.generate([OTHER, PROMPT, PROMPT, OTHER],
                         [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
                          SamplingParams(**params),
                          SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),
                          SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True)],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    # A fresh engine (another run) draws the same tokens too.
    other_run = LLM(model_path, kv_cache_memory="16MiB", show_progress=False, seed=99)
    assert gen(other_run, PROMPT, **params)[0].outputs[0].token_ids == alone


def test_different_seeds_differ(llm):
    a = tokens(llm, temperature=1.0, seed=1, max_tokens=12)
    b = tokens(llm, temperature=1.0, seed=2, max_tokens=12)
    assert a != b


def test_n_samples(llm):
    (out,) = gen(llm, PROMPT, n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    # Sample i is seeded with seed + i.
    assert out.outputs[0].token_ids == tokens(llm, temperature=1.0, seed=7, max_tokens=8)
    assert out.outputs[1].token_ids == tokens(llm, temperature=1.0, seed=8, max_tokens=8)
    (unseeded,) = gen(llm, PROMPT, n=3, temperature=1.0, max_tokens=4)
    assert len(unseeded.outputs) == 3 and unseeded.finished


# ---- greedy and truncation -------------------------------------------------------------------
def test_temperature_zero_is_argmax(llm, greedy):
    (out,) = gen(llm, PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    comp = out.outputs[0]
    assert comp.token_ids == greedy
    assert num_repeats(greedy) > 0            # the random model loops: the penalty tests need that
    for token, position in zip(comp.token_ids, comp.logprobs):
        assert position[token].rank == 1 and len(position) == 2
        assert position[token].logprob == pytest.approx(max(lp.logprob for lp in position.values()))
    # Greedy does not depend on the seed.
    assert tokens(llm, temperature=0.0, seed=5, max_tokens=16) == greedy


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_truncation_to_one_token_equals_greedy(llm, greedy, params):
    assert tokens(llm, temperature=1.0, seed=3, max_tokens=16, **params) == greedy


def test_high_temperature_is_not_greedy(llm, greedy):
    assert tokens(llm, temperature=1.5, seed=3, max_tokens=16) != greedy


# ---- penalties (end to end: direction) ------------------------------------------------------
@pytest.mark.parametrize("params", [dict(repetition_penalty=5.0), dict(frequency_penalty=2.0),
                                    dict(presence_penalty=2.0)])
def test_penalties_reduce_repetition(llm, greedy, params):
    penalised = tokens(llm, temperature=0.0, max_tokens=16, **params)
    assert num_repeats(penalised) < num_repeats(greedy)
    # A penalty only acts once a token has been seen: the first token is unchanged.
    assert penalised[0] == greedy[0]


def test_negative_presence_penalty_increases_repetition(llm, greedy):
    encouraged = tokens(llm, temperature=0.0, max_tokens=16, presence_penalty=-2.0)
    assert num_repeats(encouraged) > num_repeats(greedy)


# ---- stopping --------------------------------------------------------------------------------
def test_stop_token_ids_set_stop_reason(llm, greedy):
    i = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    (out,) = gen(llm, PROMPT, temperature=0.0, max_tokens=16, stop_token_ids=[greedy[i]])
    comp = out.outputs[0]
    assert comp.token_ids == greedy[:i + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == greedy[i]


def test_max_tokens_finishes_with_length(llm, greedy):
    (out,) = gen(llm, PROMPT, temperature=0.0, max_tokens=5, ignore_eos=True)
    assert out.outputs[0].token_ids == greedy[:5]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].stop_reason is None


@pytest.fixture(scope="module")
def eos_llm(model_path, greedy, tmp_path_factory) -> LLM:
    """The same model with its greedy first token declared an EOS token (via a tokenizer directory
    whose generation_config.json lists it), so EOS handling can be steered deterministically."""
    tok_dir = str(tmp_path_factory.mktemp("eos_tokenizer"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(model_path, name), tok_dir)
    with open(os.path.join(tok_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [EOS_ID, greedy[0]]}, f)
    engine = LLM(model_path, tokenizer=tok_dir, kv_cache_memory="16MiB", show_progress=False)
    assert greedy[0] in engine.get_tokenizer().eos_token_ids
    return engine


def test_eos_stops_and_ignore_eos_continues(eos_llm, greedy):
    (out,) = gen(eos_llm, PROMPT, temperature=0.0, max_tokens=8)
    comp = out.outputs[0]
    assert comp.token_ids == [greedy[0]]
    assert comp.finish_reason == "stop" and comp.stop_reason is None
    (out,) = gen(eos_llm, PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True)
    assert out.outputs[0].token_ids == greedy[:8] and out.outputs[0].finish_reason == "length"


def test_min_tokens_blocks_eos(eos_llm, greedy):
    eos = eos_llm.get_tokenizer().eos_token_ids
    (out,) = gen(eos_llm, PROMPT, temperature=0.0, max_tokens=12, min_tokens=4)
    comp = out.outputs[0]
    assert len(comp.token_ids) >= 4
    assert not eos & set(comp.token_ids[:4])
    assert comp.token_ids[0] != greedy[0]          # the greedy choice was masked
    if comp.finish_reason == "stop":
        assert comp.token_ids[-1] in eos
    # Sampled rows are masked too, not only greedy ones.
    for seed in range(3):
        ids = tokens(eos_llm, temperature=1.0, top_k=2, seed=seed, max_tokens=6, min_tokens=6, ignore_eos=False)
        assert len(ids) == 6 and not eos & set(ids)


def test_min_tokens_blocks_stop_token_ids(llm, greedy):
    (out,) = gen(llm, PROMPT, temperature=0.0, max_tokens=10, min_tokens=3, stop_token_ids=[greedy[0]],
                 ignore_eos=True)
    comp = out.outputs[0]
    assert comp.token_ids[0] != greedy[0] and greedy[0] not in comp.token_ids[:3]
    assert len(comp.token_ids) >= 3


# ---- logprobs --------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 3])
def test_sample_logprobs(llm, k):
    (out,) = gen(llm, PROMPT, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True, logprobs=k)
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids) == 10
    for token, position in zip(comp.token_ids, comp.logprobs):
        assert token in position and len(position) <= k + 1
        chosen = position[token]
        others = [lp for t, lp in position.items() if t != token]
        top = sorted(position.values(), key=lambda lp: -lp.logprob)
        assert [lp.rank for lp in top[:k]] == list(range(1, k + 1))
        if chosen.rank <= k:                        # among the top-k: exactly k entries
            assert len(position) == k
            assert chosen.rank == 1 + sum(lp.logprob > chosen.logprob for lp in others)
        else:                                       # the sampled token comes on top of the top-k
            assert len(position) == k + 1
            assert all(lp.logprob > chosen.logprob for lp in others)
        assert all(lp.logprob <= 0 for lp in position.values())
        assert sum(math.exp(lp.logprob) for lp in position.values()) <= 1 + 1e-5
    assert comp.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(comp.token_ids, comp.logprobs)))
    assert gen(llm, PROMPT, max_tokens=2)[0].outputs[0].logprobs is None


def test_logprobs_are_raw_and_do_not_depend_on_temperature(llm, greedy):
    cold = gen(llm, PROMPT, temperature=0.0, max_tokens=1, logprobs=5)[0].outputs[0].logprobs[0]
    hot = gen(llm, PROMPT, temperature=1.7, seed=1, max_tokens=1, logprobs=5)[0].outputs[0].logprobs[0]
    top_cold = {t: lp.logprob for t, lp in cold.items() if lp.rank <= 5}
    top_hot = {t: lp.logprob for t, lp in hot.items() if lp.rank <= 5}
    assert top_cold.keys() == top_hot.keys() and greedy[0] in top_cold
    for t in top_cold:
        assert top_cold[t] == pytest.approx(top_hot[t], abs=1e-5)


def test_prompt_logprobs(llm, greedy):
    prompt = PROMPT["prompt_token_ids"] + [greedy[0]]
    (out,) = gen(llm, {"prompt_token_ids": prompt}, max_tokens=1, prompt_logprobs=2)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for token, position in zip(prompt[1:], plp[1:]):
        assert token in position and len(position) <= 3
        assert position[token].rank >= 1
    # The last prompt token was the greedy continuation of the rest: rank 1, and the same logprob
    # the decode path reports for it.
    decoded = gen(llm, PROMPT, temperature=0.0, max_tokens=1, logprobs=0)[0].outputs[0].logprobs[0]
    assert plp[-1][greedy[0]].rank == 1
    assert plp[-1][greedy[0]].logprob == pytest.approx(decoded[greedy[0]].logprob, abs=1e-4)


def test_prompt_logprobs_survive_prefix_cache_and_chunking(llm, model_path):
    prompt = {"prompt_token_ids": list(range(60, 100))}    # 40 tokens, several blocks
    gen(llm, prompt, max_tokens=1)                          # warm the prefix cache
    (cached,) = gen(llm, prompt, max_tokens=1, prompt_logprobs=1)
    assert len(cached.prompt_logprobs) == 40 and all(p is not None for p in cached.prompt_logprobs[1:])
    chunked_llm = LLM(model_path, kv_cache_memory="16MiB", show_progress=False, max_num_batched_tokens=8)
    (chunked,) = gen(chunked_llm, prompt, max_tokens=1, prompt_logprobs=1)
    assert len(chunked.prompt_logprobs) == 40
    for a, b in zip(cached.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) and a[t].rank == b[t].rank


def test_preemption_keeps_prompt_logprobs_and_seeded_tokens(llm, model_path):
    """A request preempted mid-prefill recomputes its prompt: its prompt logprobs must come out once,
    aligned with the prompt, and a seeded request's tokens must not change."""
    small = LLM(model_path, max_model_len=64, num_gpu_blocks_override=5, max_num_batched_tokens=8,
                show_progress=False)   # 4 usable blocks of 16 tokens
    grower = ({"prompt_token_ids": list(range(10, 30))}, SamplingParams(max_tokens=40, ignore_eos=True, seed=1))
    scored = ({"prompt_token_ids": list(range(100, 140))},
              SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1, temperature=0.0))
    engine = small.engine
    engine.add_request("grower", *grower)
    for _ in range(12):
        engine.step()
    engine.add_request("scored", *scored)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.scheduler.num_preemptions > 0
    ref_grower, ref_scored = llm.generate([grower[0], scored[0]], [grower[1], scored[1]], use_tqdm=False)
    assert done["grower"].outputs[0].token_ids == ref_grower.outputs[0].token_ids
    assert done["scored"].outputs[0].token_ids == ref_scored.outputs[0].token_ids
    got, want = done["scored"].prompt_logprobs, ref_scored.prompt_logprobs
    assert len(got) == len(want) == 40 and got[0] is None
    for token, a, b in zip(scored[0]["prompt_token_ids"][1:], got[1:], want[1:]):
        assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)
