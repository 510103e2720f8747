"""Verifying drafts against the target model, keeping the target's distribution exactly.

A request with k drafts brings k + 1 rows of target logits: row j is the target's distribution p_j
for the token after the context and drafts d_1..d_j. Draft d_{j+1} is accepted with probability
p_j(d_{j+1}) (our proposers' drafts are single tokens, a draft distribution q that is one-hot, so the
classic min(1, p/q) test reduces to that). At the first rejection the token is drawn instead from p_j
with d_{j+1} removed and renormalised, the residual max(p - q, 0); if all k are accepted, a bonus
token is drawn from p_k. Each output token is then distributed exactly as p (Leviathan et al. 2023,
Chen et al. 2023). Greedy rows reduce to: accept while the draft is the argmax, then the argmax.
"""
from __future__ import annotations

import torch

from shardserve.layers.sampler import Sampler, SamplingMetadata, exponential_noise


def rejection_sample(logits: torch.Tensor, md: SamplingMetadata, num_drafts: list[int],
                     draft_ids: list[int]) -> list[list[int]]:
    """logits: [sum(num_drafts[r] + 1), V], request r's rows consecutive; md: one row per logits row
    (seeded rows' generators drive both the acceptance test and the draw); draft_ids: all drafts in
    the same order. Returns each request's tokens: its accepted drafts, then one more."""
    device = logits.device
    row_starts, draft_rows, start = [], [], 0
    for n in num_drafts:
        row_starts.append(start)
        draft_rows += range(start, start + n)
        start += n + 1
    rows = torch.tensor(draft_rows, dtype=torch.long, device=device)
    drafts = torch.tensor(draft_ids, dtype=torch.long, device=device)
    greedy_tokens, probs = Sampler.distribution(logits, md)
    if probs is None:
        accepted = greedy_tokens.index_select(0, rows) == drafts
        replacement = greedy_tokens
    else:
        uniform = _uniform(len(logits), md.generators, device).index_select(0, rows)
        accept_random = uniform < probs[rows, drafts]
        row_greedy = md.greedy.index_select(0, rows)
        accepted = torch.where(row_greedy, greedy_tokens.index_select(0, rows) == drafts, accept_random)
        residual = probs.index_put((rows, drafts), torch.zeros_like(drafts, dtype=probs.dtype))
        drawn = (residual / exponential_noise(residual, md.generators)).argmax(dim=-1)
        replacement = torch.where(md.greedy, greedy_tokens, drawn)
    accepted, replacement = accepted.tolist(), replacement.tolist()   # one sync for the whole batch
    out, flat = [], 0
    for start, n in zip(row_starts, num_drafts):
        tokens = []
        for j in range(n):
            if not accepted[flat + j]:
                tokens.append(replacement[start + j])
                break
            tokens.append(draft_ids[flat + j])
        else:
            tokens.append(replacement[start + n])   # the bonus token
        out.append(tokens)
        flat += n
    return out


def _uniform(n: int, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    uniform = torch.rand(n, device=device)
    for row, gen in generators.items():
        uniform[row] = torch.rand(1, generator=gen, device=device)[0]
    return uniform
