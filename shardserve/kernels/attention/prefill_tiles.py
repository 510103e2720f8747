"""The prefill attention kernel's work list, built on the host (no Triton here, so CPU tests can
check it): each prefill chunk of a step cut into tiles of BLOCK_M queries, and per request where
its tokens start in the step, how many there are and how many cached ones precede them. A CUDA
graph replays one fixed-size list, so the list can be padded (`num_tiles`, `num_reqs`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardserve.transfer import to_device
from shardserve.utils import cdiv

BLOCK_M = 64   # queries per tile (the kernel's BLOCK_M)


@dataclass
class PrefillTiles:
    """The step's prefill chunks cut into tiles, built on the host once per step for every layer."""

    data: torch.Tensor           # int32, tiles_data's layout
    num_tiles: int
    num_reqs: int
    block_tables: torch.Tensor   # [num_reqs, max_blocks] int32: the prefill requests' rows


def tiles_data(token_starts: list[int], query_lens: list[int], context_lens: list[int],
               num_tiles: int | None = None, num_reqs: int | None = None) -> np.ndarray:
    """The kernel's tiles_ptr contents: each tile's request (num_tiles), each tile's first query
    (num_tiles), then per request its first token in the step, its query length and its context
    length (num_reqs each). num_tiles / num_reqs (a CUDA graph's fixed sizes) pad the lists: padding
    requests have no queries, and padding tiles belong to the last request, a padding one, so their
    programs store nothing and read no keys."""
    tile_req = [r for r, n in enumerate(query_lens) for _ in range(0, n, BLOCK_M)]
    tile_m = [m for n in query_lens for m in range(0, n, BLOCK_M)]
    pad_reqs = 0 if num_reqs is None else num_reqs - len(query_lens)
    pad_tiles = 0 if num_tiles is None else num_tiles - len(tile_req)
    if pad_tiles < 0 or pad_reqs < (1 if pad_tiles else 0):
        raise ValueError(f"{len(tile_req)} tiles of {len(query_lens)} requests do not fit {num_tiles} tiles "
                         f"and {num_reqs} requests with a padding one")
    tile_req += [len(query_lens) + pad_reqs - 1] * pad_tiles
    tile_m += [0] * pad_tiles
    pad = [0] * pad_reqs
    return np.asarray(tile_req + tile_m + token_starts + pad + query_lens + pad + context_lens + pad, dtype=np.int32)


def max_tiles(num_tokens: int, num_reqs: int) -> int:
    """The most tiles num_tokens queries split among num_reqs requests can take."""
    return (num_tokens + (BLOCK_M - 1) * num_reqs) // BLOCK_M


def build_prefill_tiles(token_starts: list[int], query_lens: list[int], context_lens: list[int],
                        block_tables: torch.Tensor, device: torch.device) -> PrefillTiles:
    data = tiles_data(token_starts, query_lens, context_lens)
    num_tiles = sum(cdiv(n, BLOCK_M) for n in query_lens)
    return PrefillTiles(to_device(data, torch.int32, device), num_tiles, len(query_lens), block_tables)
