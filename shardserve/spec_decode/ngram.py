"""N-gram (prompt lookup) proposals: the context's last n tokens are looked up earlier in the same
context, and the tokens that followed an earlier occurrence are proposed. Pays off where the
answer repeats the input (editing, summarising, code), and costs nothing where nothing matches."""
from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` draft tokens for what follows `token_ids`: the longest suffix of n tokens
    (max_n >= n >= min_n) that also occurs earlier, continued from its latest earlier occurrence
    that has k tokens after it (recent context predicts best), or else from its earliest.
    Returns [] when no suffix of at least min_n tokens occurs earlier."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Starts i of earlier windows tokens[i:i+n] equal to the suffix, each followed by a token.
        starts = length - n
        match = tokens[:starts] == tokens[starts]
        for j in range(1, n):
            if not match.any():
                break
            match &= tokens[j:starts + j] == tokens[starts + j]
        hits = np.flatnonzero(match)
        if len(hits):   # the latest occurrence with k tokens after it, else the one with the most
            full = hits[hits + n + k <= length]
            follow = (full[-1] if len(full) else hits[0]) + n
            return tokens[follow:follow + k].tolist()
    return []
