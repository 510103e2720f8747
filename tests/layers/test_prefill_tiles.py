"""The prefill kernel's tile list (kernels/attention/prefill_tiles.py), read back the way the kernel
reads it: every query of every chunk in exactly one real tile, padded lists (CUDA graphs) adding
only tiles of a request with no queries, and max_tiles a tight bound."""
from __future__ import annotations

import itertools
import random

import pytest

from shardserve.kernels.attention.prefill_tiles import BLOCK_M, max_tiles, tiles_data


def _read(data, num_tiles: int, num_reqs: int) -> list[tuple[int, int, int]]:
    """(flat token, query index, context) of every query each tile covers, as the kernel sees it."""
    covered = []
    for tile in range(num_tiles):
        r, m0 = data[tile], data[num_tiles + tile]
        start, q_len, ctx = (data[2 * num_tiles + i * num_reqs + r] for i in range(3))
        covered += [(start + m, m, ctx) for m in range(m0, m0 + BLOCK_M) if m < q_len]
    return covered


def _expected(query_lens, context_lens):
    starts = list(itertools.accumulate([0] + query_lens[:-1]))
    return starts, sorted((s + m, m, c) for s, n, c in zip(starts, query_lens, context_lens) for m in range(n))


@pytest.mark.parametrize("seed", range(20))
def test_every_query_in_exactly_one_tile_padded_or_not(seed):
    rng = random.Random(seed)
    reqs = rng.randint(1, 4)
    query_lens = [rng.choice([1, 2, 63, 64, 65, rng.randint(1, 200)]) for _ in range(reqs)]
    context_lens = [rng.randint(0, 300) for _ in range(reqs)]
    starts, want = _expected(query_lens, context_lens)
    exact = tiles_data(starts, query_lens, context_lens)
    num_tiles = (len(exact) - 3 * reqs) // 2
    assert sorted(_read(exact, num_tiles, reqs)) == want
    total = sum(query_lens)
    padded = tiles_data(starts, query_lens, context_lens, max_tiles(total, 4), 5)
    assert sorted(_read(padded, max_tiles(total, 4), 5)) == want
    pad_tiles = padded[num_tiles:max_tiles(total, 4)]
    assert all(padded[2 * max_tiles(total, 4) + 5 + r] == 0 for r in pad_tiles)   # no queries


def _tiles(split) -> int:
    return sum(-(-n // BLOCK_M) for n in split)


def test_max_tiles_is_the_most_any_split_takes():
    """Brute force over every split of up to two requests (one query each at least); with more, a
    split of requests of BLOCK_M + 1 queries and the rest reaches the bound."""
    for tokens in range(1, 260, 11):
        for reqs in (1, 2):
            splits = (s for k in range(1, reqs + 1) for s in itertools.product(range(1, tokens + 1), repeat=k)
                      if sum(s) <= tokens)
            assert max_tiles(tokens, reqs) == max(_tiles(s) for s in splits), (tokens, reqs)
        for reqs in (3, 4):
            rest = tokens - (reqs - 1) * (BLOCK_M + 1)
            if rest > 0:
                assert max_tiles(tokens, reqs) == _tiles([BLOCK_M + 1] * (reqs - 1) + [rest]), (tokens, reqs)


def test_a_list_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        tiles_data([0, 70], [70, 70], [0, 0], num_tiles=3, num_reqs=3)   # 4 tiles
    with pytest.raises(ValueError, match="padding one"):
        tiles_data([0], [10], [0], num_tiles=2, num_reqs=1)   # no request left to own the padding tile
