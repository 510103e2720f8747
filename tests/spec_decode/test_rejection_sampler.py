"""The rejection sampler keeps the target's distribution: each output token, drafts accepted or not,
is distributed as the target says (checked on many draws, every cell within 5 standard errors), for
drafts the target likes and drafts it dislikes, with top-k applied; greedy rows take the argmax."""
from __future__ import annotations

import torch

from shardserve.layers.sampler import SamplingMetadata
from shardserve.spec_decode.rejection_sampler import rejection_sample
from shardserve.worker.sampling_inputs import request_generator

V = 6
# Target distributions at the three rows of a request with two drafts: for token 1, for token 2
# (given draft 1 was taken), and the bonus row.
P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                  [0.05, 0.05, 0.50, 0.30, 0.05, 0.05],
                  [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]])


def _metadata(rows: int, greedy: bool = False, top_k: int | None = None) -> SamplingMetadata:
    ones = torch.ones(rows)
    return SamplingMetadata(temperature=ones, greedy=torch.full((rows,), greedy), all_greedy=greedy,
                            top_k=None if top_k is None else torch.full((rows,), top_k, dtype=torch.long))


def _run(drafts: list[int], n: int, top_k: int | None = None) -> list[list[int]]:
    torch.manual_seed(1234)
    logits = P.log().repeat(n, 1)
    return rejection_sample(logits, _metadata(len(logits), top_k=top_k), [len(drafts)] * n, drafts * n)


def _assert_distributed_as(tokens: list[int], p: torch.Tensor) -> None:
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = p.double() * n
    sigma = (p.double() * (1 - p.double()) * n).sqrt().clamp(min=1.0)
    assert ((counts - expected).abs() <= 5 * sigma).all(), (counts.tolist(), expected.tolist())


def _top_k(p: torch.Tensor, k: int) -> torch.Tensor:
    keep = torch.zeros_like(p)
    keep[p.topk(k).indices] = 1
    return p * keep / (p * keep).sum()


def test_output_tokens_follow_the_target_for_liked_and_disliked_drafts():
    n = 40000
    for drafts in ([0, 2], [5, 0], [3, 4]):   # likely, unlikely first draft; drafts the 2nd row dislikes
        out = _run(drafts, n)
        _assert_distributed_as([t[0] for t in out], P[0])
        # Given the first draft was the first token, the second is distributed as row 1 says.
        second = [t[1] for t in out if t[0] == drafts[0]]
        _assert_distributed_as(second, P[1])
        # And where both drafts were taken, the bonus token follows row 2.
        third = [t[2] for t in out if t[:2] == drafts]
        if len(third) > 1000:
            _assert_distributed_as(third, P[2])
        accepted_first = sum(t[0] == drafts[0] and len(t) > 1 for t in out) / n
        assert abs(accepted_first - P[0, drafts[0]].item()) < 0.01   # accepted with probability p(draft)


def test_top_k_restricts_both_the_test_and_the_residual():
    out = _run([4, 2], 40000, top_k=3)   # the first draft lies outside the top 3: never accepted
    assert all(len(t) == 1 for t in out)
    _assert_distributed_as([t[0] for t in out], _top_k(P[0], 3))


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    logits = P.log().repeat(3, 1)
    md = _metadata(len(logits), greedy=True)
    out = rejection_sample(logits, md, [2, 2, 2], [0, 2, 0, 3, 1, 2])
    assert out == [[0, 2, 5], [0, 2], [0]]


def test_requests_without_drafts_draw_one_token_and_seeded_rows_repeat():
    logits = torch.cat([P[:1].log(), P.log()])
    md = _metadata(4)

    def draw() -> list[list[int]]:
        md.generators = {row: request_generator(7, row, torch.device("cpu")) for row in range(4)}
        return rejection_sample(logits, md, [0, 2], [5, 0])
    first = draw()
    assert len(first[0]) == 1 and 1 <= len(first[1]) <= 3
    assert all(draw() == first for _ in range(5))
