"""Turn the sampled requests' SamplingParams into the batched tensors the Sampler consumes."""
from __future__ import annotations

import torch

from shardserve.layers.sampler import SamplingMetadata
from shardserve.transfer import to_device
from shardserve.worker.input_batch import CachedRequestState

_SEED_MIX = 0x9E3779B97F4A7C15


def request_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """A generator for one draw, keyed by (seed, output position): a seeded request's tokens do not
    depend on its batch-mates, nor on whether it was preempted and recomputed."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * _SEED_MIX + position) % (2**63 - 1))
    return gen


def build_sampling_metadata(states: list[CachedRequestState], outputs_before: list[int], vocab_size: int,
                            eos_token_ids: frozenset[int], device: torch.device,
                            pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplingMetadata:
    """outputs_before[row]: output tokens the request has before this draw, those still in flight
    included. pending: (rows, token ids on the device) of such in-flight tokens, which the worker's
    token lists do not hold yet but penalties must count."""
    params = [s.sampling_params for s in states]
    n = len(params)

    def column(values, dtype=torch.float32) -> torch.Tensor:
        return to_device(values, dtype, device)

    greedy = [p.greedy for p in params]
    if all(greedy):   # the sampler takes the argmax and reads neither column
        md = SamplingMetadata(temperature=None, greedy=None, all_greedy=True)
    else:
        md = SamplingMetadata(temperature=column([p.temperature for p in params]),
                              greedy=column(greedy, torch.bool), all_greedy=False)
    sampling = [p for p in params if not p.greedy]
    if any(p.top_p < 1.0 for p in sampling):
        md.top_p = column([p.top_p for p in params])
    if any(p.top_k > 0 for p in sampling):   # k past the vocabulary keeps it all (and must fit an int64)
        md.top_k = column([min(p.top_k, vocab_size) for p in params], torch.long)
    if any(p.min_p > 0.0 for p in sampling):
        md.min_p = column([p.min_p for p in params])
    blocked_rows, blocked_ids = [], []
    for row, (p, before) in enumerate(zip(params, outputs_before)):
        if p.seed is not None and not p.greedy:
            md.generators[row] = request_generator(p.seed, before, device)
        if before < p.min_tokens and p.structured_outputs is None:   # a grammar decides where it may end
            blocked = sorted(set(p.stop_token_ids) | eos_token_ids)
            blocked_rows += [row] * len(blocked)
            blocked_ids += blocked
    if blocked_ids:
        md.blocked_tokens = (column(blocked_rows, torch.long), column(blocked_ids, torch.long))
    biased = [(row, t, b) for row, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if biased:
        rows, ids, biases = zip(*biased)
        md.logit_bias = (column(rows, torch.long), column(ids, torch.long), column(biases))
    if any(p.uses_penalties for p in params):
        counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        prompt_mask = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
        for row, state in enumerate(states):
            out = column(state.token_ids[state.num_prompt_tokens:], torch.long)
            counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
            prompt_mask[row, column(state.token_ids[:state.num_prompt_tokens], torch.long)] = True
        if pending is not None:
            rows, tokens = pending
            counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        md.output_token_counts, md.prompt_token_mask = counts, prompt_mask
        md.presence_penalty = column([p.presence_penalty for p in params])
        md.frequency_penalty = column([p.frequency_penalty for p in params])
        md.repetition_penalty = column([p.repetition_penalty for p in params])
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if wanted:
        md.num_logprobs = -1 if -1 in wanted else min(max(wanted), vocab_size)
    return md
