"""The Sampler's exact arithmetic on hand-made logits: penalties, truncation, draws, seeds, and
the sampling metadata built from SamplingParams."""
from __future__ import annotations

import pytest
import torch

from shardserve import SamplingParams
from shardserve.layers.sampler import Sampler, SamplingMetadata, _apply_top_k_top_p, apply_penalties
from shardserve.worker.input_batch import CachedRequestState
from shardserve.worker.sampling_inputs import build_sampling_metadata

V = 5
LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
COUNTS = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0]])          # outputs so far: token 1 twice, token 3 once
PROMPT_MASK = torch.tensor([[True, False, False, False, False]])   # token 0 is in the prompt


def penalty_md(rep: float = 1.0, freq: float = 0.0, pres: float = 0.0) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.ones(1), greedy=torch.ones(1, dtype=torch.bool), all_greedy=True,
                            presence_penalty=torch.tensor([pres]), frequency_penalty=torch.tensor([freq]),
                            repetition_penalty=torch.tensor([rep]), output_token_counts=COUNTS.clone(),
                            prompt_token_mask=PROMPT_MASK.clone())


@pytest.mark.parametrize("penalties,expected", [
    # Repetition: seen tokens (prompt or output) have positive logits divided, negative multiplied.
    (dict(rep=2.0), [1.0, -2.0, 0.5, 1.5, -2.0]),
    (dict(rep=0.5), [4.0, -0.5, 0.5, 6.0, -2.0]),
    # Frequency: minus freq x output count (prompt tokens do not count).
    (dict(freq=0.5), [2.0, -2.0, 0.5, 2.5, -2.0]),
    # Presence: minus pres once for any token that was output.
    (dict(pres=0.25), [2.0, -1.25, 0.5, 2.75, -2.0]),
    (dict(rep=2.0, freq=0.5, pres=0.25), [1.0, -3.25, 0.5, 0.75, -2.0]),
    (dict(), [2.0, -1.0, 0.5, 3.0, -2.0]),
])
def test_penalty_arithmetic(penalties, expected):
    out = apply_penalties(LOGITS.clone(), penalty_md(**penalties))
    assert out[0].tolist() == pytest.approx(expected)


def test_sampler_greedy_choice_follows_penalties():
    sampler = Sampler()
    assert sampler(LOGITS.clone(), penalty_md())[0].tolist() == [3]
    assert sampler(LOGITS.clone(), penalty_md(rep=2.5))[0].tolist() == [3]    # 3 -> 1.2 still beats 0 -> 0.8
    assert sampler(LOGITS.clone(), penalty_md(rep=7.0))[0].tolist() == [2]    # 3 -> 0.43, 0 -> 0.29 < 0.5
    assert sampler(LOGITS.clone(), penalty_md(freq=1.5))[0].tolist() == [0]   # 3 -> 1.5 < 2
    assert sampler(LOGITS.clone(), penalty_md(pres=1.5))[0].tolist() == [0]


def test_build_sampling_metadata_counts_and_neutral_rows():
    def state(rid: str, ids: list[int], num_prompt: int, params: SamplingParams) -> CachedRequestState:
        return CachedRequestState(rid, ids, num_prompt, params, [], 0)

    penalised = state("a", [0, 0, 4, 1, 1, 3], 3, SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                                                                 presence_penalty=0.25, temperature=0.0))
    plain = state("b", [0, 1, 3, 3], 2, SamplingParams(temperature=0.0))
    md = build_sampling_metadata([penalised, plain], [3, 2], V, frozenset(), torch.device("cpu"))
    assert md.output_token_counts.tolist() == [[0, 2, 0, 1, 0], [0, 0, 0, 2, 0]]
    assert md.prompt_token_mask.tolist() == [[True, False, False, False, True], [True, True, False, False, False]]
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]] * 2)
    out = apply_penalties(logits.clone(), md)
    assert out[0].tolist() == pytest.approx([1.0, -3.25, 0.5, 0.75, -4.0])   # 4 is in the prompt
    assert out[1].tolist() == logits[1].tolist()      # a row without penalties is untouched


def test_penalties_count_tokens_still_in_flight():
    """Async scheduling: a token sampled by the step before is not in the worker's list yet; the
    runner hands it over as (row, token) and it counts like the others."""
    params = SamplingParams(frequency_penalty=1.0, temperature=0.0)
    a = CachedRequestState("a", [0, 1, 3], 2, params, [], 0)   # outputs [3] known, one more in flight
    b = CachedRequestState("b", [0, 1, 3], 2, params, [], 0)
    pending = (torch.tensor([0, 1]), torch.tensor([3, 2]))
    md = build_sampling_metadata([a, b], [2, 2], V, frozenset(), torch.device("cpu"), pending)
    assert md.output_token_counts.tolist() == [[0, 0, 0, 2, 0], [0, 0, 1, 1, 0]]


def test_min_tokens_masks_eos_and_stop_ids_in_metadata():
    params = SamplingParams(min_tokens=2, stop_token_ids=[3], temperature=0.0)
    early = CachedRequestState("a", [0, 1, 4], 2, params, [], 0)         # 1 output token so far
    late = CachedRequestState("b", [0, 1, 4, 4], 2, params, [], 0)       # 2: no longer masked
    md = build_sampling_metadata([early, late], [1, 2], V, frozenset({4}), torch.device("cpu"))
    rows, ids = md.blocked_tokens
    assert rows.tolist() == [0, 0] and ids.tolist() == [3, 4]
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 4.0]] * 2)
    assert Sampler()(logits, md)[0].tolist() == [0, 3]


def test_top_k_top_p_min_p_keep_the_right_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()

    def kept(top_k=None, top_p=None) -> list[int]:
        out = _apply_top_k_top_p(logits.clone(), None if top_k is None else torch.tensor([top_k]),
                                 None if top_p is None else torch.tensor([top_p]))
        return torch.isfinite(out[0]).nonzero().flatten().tolist()

    assert kept(top_k=1) == [0]
    assert kept(top_k=3) == [0, 1, 2]
    assert kept(top_k=0) == [0, 1, 2, 3]            # 0 = off
    assert kept(top_p=0.45) == [0]                  # token 0 alone has 0.5
    assert kept(top_p=0.6) == [0, 1]                # smallest set reaching 0.6
    assert kept(top_p=0.9) == [0, 1, 2]
    assert kept(top_p=1e-9) == [0]                  # the best token always survives
    assert kept(top_k=2, top_p=0.9) == [0, 1]

    # min_p through the sampler: tokens below min_p x max prob are never drawn.
    n = 400
    md = SamplingMetadata(temperature=torch.ones(n), greedy=torch.zeros(n, dtype=torch.bool), all_greedy=False,
                          min_p=torch.full((n,), 0.4))
    torch.manual_seed(0)
    drawn = Sampler()(logits.expand(n, -1).clone(), md)[0]
    assert set(drawn.tolist()) == {0, 1}            # 0.15 < 0.4 x 0.5


def test_sampler_draws_from_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    md = SamplingMetadata(temperature=torch.ones(n), greedy=torch.zeros(n, dtype=torch.bool), all_greedy=False)
    torch.manual_seed(0)
    drawn = Sampler()(probs.log().expand(n, -1).clone(), md)[0]
    freq = torch.bincount(drawn, minlength=4).float() / n
    assert freq.tolist() == pytest.approx(probs.tolist(), abs=0.015)
    # Temperature sharpens: at 0.5 the weights are squared.
    md.temperature = torch.full((n,), 0.5)
    drawn = Sampler()(probs.log().expand(n, -1).clone(), md)[0]
    sharp = probs**2 / (probs**2).sum()
    assert (torch.bincount(drawn, minlength=4).float() / n).tolist() == pytest.approx(sharp.tolist(), abs=0.015)


def test_seeded_rows_ignore_their_batch():
    from shardserve.worker.sampling_inputs import request_generator
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))

    def draw(batch_logits: torch.Tensor, row: int) -> int:
        n = batch_logits.shape[0]
        md = SamplingMetadata(temperature=torch.ones(n), greedy=torch.zeros(n, dtype=torch.bool), all_greedy=False,
                              generators={row: request_generator(42, 0, torch.device("cpu"))})
        return Sampler()(batch_logits, md)[0][row].item()

    alone = draw(logits.clone(), 0)
    torch.manual_seed(123)
    assert draw(torch.cat([torch.randn(3, 50), logits, torch.randn(2, 50)]), 3) == alone
    assert {draw(logits.clone(), 0) for _ in range(3)} == {alone}


def test_logit_bias_moves_sampling_but_not_the_returned_logprobs():
    vocab = 8
    states = [CachedRequestState(str(i), [1, 2], 2, p, [1], 1) for i, p in enumerate([
        SamplingParams(temperature=0, logit_bias={5: 100.0}, logprobs=1),
        SamplingParams(temperature=0, logit_bias={0: -100.0, 3: 2.5}),
        SamplingParams(temperature=0)])]
    md = build_sampling_metadata(states, [0, 0, 0], vocab, frozenset(), torch.device("cpu"))
    logits = torch.zeros(3, vocab)
    logits[:, 0] = 1.0   # every row prefers token 0
    sampled, lp_rows = Sampler()(logits.clone(), md)
    assert sampled.tolist() == [5, 3, 0]
    ids, lps, _ = lp_rows
    assert ids[0, 0].item() == 5 and lps[0, 0].item() == pytest.approx(torch.log_softmax(logits[0], 0)[5].item())
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 150.0})
