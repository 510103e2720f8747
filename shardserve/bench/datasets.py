"""Benchmark prompts. `random` (vLLM's): random token ids decoded to text, each prompt of a length
drawn uniformly from [len * (1 - ratio), len * (1 + ratio)], so the server sees the token counts
asked for (re-encoding decoded random ids can drift by a few tokens; lengths are re-measured)."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


def _lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    tokenizer=None, vocab_size: int | None = None) -> list[BenchRequest]:
    """With a tokenizer: text prompts (work on any endpoint). Without one: token-id prompts, which
    only /v1/completions accepts; vocab_size bounds the ids."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    if tokenizer is None:
        if vocab_size is None:
            raise ValueError("random token prompts need a vocabulary size (or a tokenizer)")
        for n, out in zip(in_lens, out_lens):
            requests.append(BenchRequest([rng.randrange(vocab_size) for _ in range(n)], n, out))
        return requests
    special = set(tokenizer.all_special_ids) if hasattr(tokenizer, "all_special_ids") else set()
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
    for n, out in zip(in_lens, out_lens):
        text = tokenizer.decode([rng.choice(vocab) for _ in range(n)])
        ids = tokenizer.encode(text, add_special_tokens=False)[:n]
        text = tokenizer.decode(ids)
        requests.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), out))
    return requests
