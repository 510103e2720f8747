"""Verification keeps the target's distribution: each output token, drafts accepted or not, is
distributed as the target says (checked on many draws, every cell within 5 standard errors), for
drafts the target likes and drafts it dislikes, with top-k applied; a draft is accepted with
probability p(draft); greedy rows take the argmax; seeded rows draw what they draw without drafts."""
from __future__ import annotations

import torch

from shardserve.layers.sampler import Sampler, SamplingMetadata
from shardserve.spec_decode.rejection_sampler import accept_drafts
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


def verify(logits: torch.Tensor, md: SamplingMetadata, num_drafts: list[int], drafts: list[int]) -> list[list[int]]:
    """What the model runner does: draw every row with the sampler, then accept drafts."""
    rows, _ = Sampler()(logits, md)
    return accept_drafts(rows.tolist(), num_drafts, drafts)


def _run(drafts: list[int], n: int, top_k: int | None = None) -> list[list[int]]:
    torch.manual_seed(1234)
    logits = P.log().repeat(n, 1)
    return verify(logits, _metadata(len(logits), top_k=top_k), [len(drafts)] * n, drafts * n)


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
    out = verify(logits, md, [2, 2, 2], [0, 2, 0, 3, 1, 2])
    assert out == [[0, 2, 5], [0, 2], [0]]


def test_seeded_rows_draw_what_they_draw_without_drafts():
    """A seeded request's row at output position p draws from (seed, p) whether it verifies a draft
    or not: its tokens do not depend on the drafts."""
    def draw(rows: list[int], num_drafts: list[int], drafts: list[int]) -> list[list[int]]:
        md = _metadata(len(rows))   # row i is output position rows[i], whose distribution is P[rows[i]]
        md.generators = {i: request_generator(7, pos, torch.device("cpu")) for i, pos in enumerate(rows)}
        return verify(P[rows].log(), md, num_drafts, drafts)
    plain = [draw([p], [0], [])[0][0] for p in range(3)]   # one token a step at positions 0, 1, 2
    for drafts in ([plain[0], plain[1]], [5, 5], [plain[0], 5]):
        tokens = draw([0, 1, 2], [2], drafts)[0]
        assert tokens == plain[:len(tokens)]
        assert len(tokens) == 1 + (drafts[0] == plain[0]) + (drafts[:2] == plain[:2])
