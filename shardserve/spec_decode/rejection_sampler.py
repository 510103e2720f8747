"""Verifying drafts against the target model, keeping the target's distribution exactly.

A request with k drafts brings k + 1 rows of target logits: row j is the target's distribution p_j
for the token after the context and drafts d_1..d_j. Our proposers' drafts are single tokens (a
draft distribution q that is one-hot), and for those the classic test (accept d with probability
min(1, p(d)/q(d)) = p(d), else draw from the residual max(p - q, 0), i.e. p without d, renormalised;
Leviathan et al. 2023, Chen et al. 2023) has an equivalent coupled form: draw each row's token t_j
from p_j exactly as a step without drafts would, accept d_{j+1} iff t_j = d_{j+1}, and at the first
mismatch keep t_j. P(accept) = p(d), and a rejected row's t_j is distributed as p given t != d:
the residual. If all k are accepted, the last row's draw is the bonus token.

The draws are the sampler's own (layers/sampler.py), a seeded request's keyed by (seed, output
position): its tokens are the same with or without speculation. Greedy rows reduce to: accept while
the draft is the argmax, then the argmax.
"""
from __future__ import annotations


def accept_drafts(row_tokens: list[int], num_drafts: list[int], draft_ids: list[int]) -> list[list[int]]:
    """row_tokens: each row's draw by the sampler, request r's num_drafts[r] + 1 rows consecutive;
    draft_ids: all drafts in the same order. Returns each request's tokens: its accepted drafts,
    then the draw of the row that rejected one (or of its last row, the bonus token)."""
    out, row, flat = [], 0, 0
    for n in num_drafts:
        tokens = []
        for j in range(n + 1):
            tokens.append(row_tokens[row + j])
            if j == n or row_tokens[row + j] != draft_ids[flat + j]:
                break
        out.append(tokens)
        row += n + 1
        flat += n
    return out
