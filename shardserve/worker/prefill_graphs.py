"""CUDA graphs for short prefill steps: the model forward of a step that holds only prefill chunks
(at most MAX_REQS requests, at most 256 tokens) is captured once per token count on a ladder, over
static buffers, as decode steps are (cuda_graphs.py).

Why: a short prompt's prefill is host-bound when run eagerly. Llama-3-8B's 128-token prefill is
~5.4 ms of kernels on an H200 but ~400 launches from Python: its time to first token was 13.0 ms
eagerly and is 6.4 ms replayed (benchmarks/BENCHMARKS.md). Longer prefills keep running eagerly: their
kernels outlast the launches, and padding them to a ladder step would cost real compute.

The prefill attention kernel takes its work as a list of tiles in a device buffer
(prefill_tiles.tiles_data); a graph has room for the most tiles its token count can take among
MAX_REQS requests, and the unused tiles belong to a padding request with no queries, so they read
and store nothing. Padding tokens write their K/V into the scratch slot past the pool's end and are
never attended to. Steps with decodes take the decode graphs or, mixed with prefills, the
piecewise ones (piecewise_graphs.py).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from shardserve.kernels.attention.prefill_tiles import PrefillTiles, max_tiles, tiles_data
from shardserve.layers.attention import AttentionContext, CommonAttentionMetadata
from shardserve.layers.attention.cuda_backend import CudaAttentionBackend, prefill_metadata
from shardserve.worker.cuda_graphs import StaticTokens, token_ladder

logger = logging.getLogger("shardserve")

MAX_REQS = 4   # prefill chunks per graphed step (a fifth, padding request takes unused tiles)
# Token counts; above 256 a prefill's kernels outlast its launches (see the module doc).
LADDER = (16, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class PrefillGraphs:
    @torch.inference_mode()
    def __init__(self, model: torch.nn.Module, backend, device: torch.device, max_tokens: int, max_blocks: int,
                 block_size: int, scratch_slot: int, pool, stream: torch.cuda.Stream) -> None:
        assert isinstance(backend, CudaAttentionBackend)   # its K/V write reads md.slots, the padded ones
        self.sizes = token_ladder(LADDER, max_tokens)
        n, reqs = self.sizes[-1], MAX_REQS + 1
        self.tokens = StaticTokens(n, scratch_slot, device)
        self.block_tables = torch.zeros(reqs, max_blocks, dtype=torch.int32, device=device)
        self.tiles: dict[int, PrefillTiles] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        before, t0 = torch.cuda.memory_allocated(device), time.perf_counter()
        side = torch.cuda.Stream(device)
        for size in reversed(self.sizes):   # largest first: the smaller graphs reuse its memory
            num_tiles = max_tiles(size, MAX_REQS)
            data = torch.from_numpy(tiles_data([], [], [], num_tiles, reqs)).to(device)   # all padding
            self.tiles[size] = PrefillTiles(data, num_tiles, reqs, self.block_tables)
            ctx = AttentionContext(backend, prefill_metadata(self.tokens.slots[:size], self.tiles[size], block_size))
            self.graphs[size], self.outputs[size] = self.tokens.capture(model, size, ctx, side, pool, stream)
        logger.info("CUDA graphs captured for prefills of up to %d requests, token counts %s (%.2f GiB, %.1f s)",
                    MAX_REQS, self.sizes, (torch.cuda.memory_allocated(device) - before) / 2**30,
                    time.perf_counter() - t0)

    def fits(self, attn: CommonAttentionMetadata) -> bool:
        return (attn.num_decodes == 0 and len(attn.query_lens) <= MAX_REQS
                and sum(attn.query_lens) <= self.sizes[-1])

    def run(self, columns: torch.Tensor, attn: CommonAttentionMetadata) -> torch.Tensor:
        """Hidden states of a prefill-only step that fits() (columns: StaticTokens.load's)."""
        t = columns.shape[1]
        size = next(s for s in self.sizes if s >= t)
        tiles = self.tiles[size]
        starts = np.cumsum([0] + attn.query_lens[:-1]).tolist()
        data = tiles_data(starts, attn.query_lens, attn.context_lens, tiles.num_tiles, tiles.num_reqs)
        tiles.data.copy_(torch.from_numpy(data).pin_memory(), non_blocking=True)
        self.tokens.load(columns, size)
        self.block_tables.zero_()   # pages past a request's blocks read the null block, as in eager steps
        self.block_tables[:attn.block_tables.shape[0], :attn.block_tables.shape[1]].copy_(attn.block_tables,
                                                                                          non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:t]
