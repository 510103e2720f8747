"""Batched sampling with vLLM's semantics.

Order of operations per row: raw logprobs (returned to users, as vLLM v1 does by default), then
logit_bias, min_tokens masking, repetition / presence / frequency penalties, greedy argmax or temperature,
min_p, top_k, top_p, and finally a draw. Draws use the exponential race (argmax of p / E with
E ~ Exp(1)), which needs no sort; a seeded row draws its noise from its own generator, seeded from
(seed, output position), so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardserve.kernels import triton_ops
from shardserve.kernels.argmax import triton_argmax

LogprobRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # token ids, logprobs, ranks: [B, 1+k]


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None          # [B]; rows with greedy=True ignore it; None when all_greedy
    greedy: torch.Tensor | None               # [B] bool; None when all_greedy
    all_greedy: bool
    top_p: torch.Tensor | None = None         # [B], None when no row uses it
    top_k: torch.Tensor | None = None         # [B] long, 0 = off
    min_p: torch.Tensor | None = None         # [B]
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Penalties (None when no row uses any).
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_token_counts: torch.Tensor | None = None   # [B, V] counts of generated tokens
    prompt_token_mask: torch.Tensor | None = None     # [B, V] bool: token occurs in the prompt
    # min_tokens: (rows, token ids) pairs to mask, as device tensors (no host sync), or None
    blocked_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (rows, token ids, biases)
    num_logprobs: int | None = None           # max over rows; -1 = whole vocabulary


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    counts = md.output_token_counts
    if md.repetition_penalty is not None:
        seen = md.prompt_token_mask | (counts > 0)
        rp = md.repetition_penalty.unsqueeze(1).expand_as(logits)
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalised, logits)
    if md.frequency_penalty is not None:
        logits = logits - md.frequency_penalty.unsqueeze(1) * counts
    if md.presence_penalty is not None:
        logits = logits - md.presence_penalty.unsqueeze(1) * (counts > 0)
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).unsqueeze(1)
        drop |= ranks >= k
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs          # mass of strictly better tokens
        drop |= before > top_p.unsqueeze(1)
    drop[:, 0] = False                                  # always keep the best token
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    return noise


def compute_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobRows:
    """For each row: the chosen token then the top-k; ranks count strictly better tokens + 1."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=-1, keepdim=True) + 1
    if k == -1:
        k = logprobs.shape[-1]
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        top_ranks = torch.arange(1, k + 1, device=logprobs.device).expand_as(top_ids)
        return (torch.cat([chosen.unsqueeze(1), top_ids], 1), torch.cat([chosen_lp, top_lp], 1),
                torch.cat([ranks, top_ranks], 1))
    return chosen.unsqueeze(1), chosen_lp, ranks


def _plain_greedy(logits: torch.Tensor, md: SamplingMetadata) -> bool:
    """Every row takes its argmax of the raw logits, and nothing else is asked for: on CUDA that is
    one Triton kernel pair (kernels/argmax/triton_argmax.py) instead of a cast and torch's one-block argmax."""
    return (md.all_greedy and md.num_logprobs is None and md.blocked_tokens is None and md.logit_bias is None
            and md.output_token_counts is None and logits.dim() == 2 and triton_ops.handles(logits))


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, LogprobRows | None]:
        if _plain_greedy(logits, md):
            return triton_argmax.argmax_rows(logits), None
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if md.num_logprobs is not None else None
        if md.logit_bias is not None:
            rows, ids, biases = md.logit_bias
            logits = logits.index_put((rows, ids), biases, accumulate=True)
        if md.blocked_tokens is not None:
            logits[md.blocked_tokens] = float("-inf")
        if md.output_token_counts is not None:
            logits = apply_penalties(logits, md)
        greedy_tokens = logits.argmax(dim=-1)
        if md.all_greedy:
            sampled = greedy_tokens
        else:
            temperature = torch.where(md.greedy, torch.ones_like(md.temperature), md.temperature)
            logits = logits / temperature.unsqueeze(1)
            if md.min_p is not None:
                probs = logits.softmax(dim=-1)
                threshold = md.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
                logits = logits.masked_fill(probs < threshold, float("-inf"))
            if md.top_k is not None or md.top_p is not None:
                logits = _apply_top_k_top_p(logits, md.top_k, md.top_p)
            probs = logits.softmax(dim=-1)
            random_tokens = (probs / _exponential_noise(probs, md.generators)).argmax(dim=-1)
            sampled = torch.where(md.greedy, greedy_tokens, random_tokens)
        logprob_rows = None
        if raw_logprobs is not None:
            logprob_rows = compute_logprobs(raw_logprobs, sampled, md.num_logprobs)
        return sampled, logprob_rows
