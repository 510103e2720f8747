"""Piecewise CUDA graphs for steps that mix decodes and prefills (or prefill more requests than
prefill_graphs.py takes): the model forward for a token count on a ladder is captured as one graph
per stretch between attention calls, and attention runs eagerly between the replays with the step's
own metadata, as vLLM's piecewise graphs do.

Why: such a step runs ~400 kernels for Llama-3-8B, and eagerly their launches from Python take
longer than the kernels (benchmarks/BENCHMARKS.md); a server pays that whenever a prompt arrives
while others decode. Here a step is 33 replays plus a few attention launches per layer.

How: during capture the attention context's backend is a `_Split`. Each attention call ends the
current graph and starts the next; the call's inputs (q, k, v, made by the graph before) and an
output buffer (read by the graph after) are captured tensors, so their addresses are fixed, and the
call is recorded. A replay runs graph 0, attention call 0 on the real backend (writing into its
output buffer), graph 1, and so on. Padding tokens past the step's own write their K/V into the
scratch slot and no attention kernel reads them.
"""
from __future__ import annotations

import logging
import time

import torch

from shardserve.kernels.attention.prefill_tiles import PrefillTiles, tiles_data
from shardserve.layers.attention import AttentionContext, CommonAttentionMetadata
from shardserve.layers.attention.cuda_backend import CudaAttentionBackend, prefill_metadata
from shardserve.worker.cuda_graphs import StaticTokens, token_ladder

logger = logging.getLogger("shardserve")

# Up to 256 tokens: longer steps are GPU-bound anyway, and each size keeps every layer's q, k, v
# alive (Llama-3-8B: 0.28 GiB for this ladder; 0.89 GiB up to 512).
LADDER = (16, 32, 64, 128, 256)


class _Split:
    """Stands in for the backend while a forward is captured: ends the graph at every attention
    call and records the call."""

    def __init__(self, backend, pieces: list[torch.cuda.CUDAGraph], calls: list[tuple], outs: list[torch.Tensor],
                 pool) -> None:
        self.backend, self.pieces, self.calls, self.outs, self.pool = backend, pieces, calls, outs, pool

    def fuses_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return self.backend.fuses_rotary(q, k, v)

    def forward(self, spec, q, k, v, kv_cache, md, rotary=None, out=None) -> torch.Tensor:
        self.pieces[-1].capture_end()
        # Between two captures: the largest size (captured first) allocates each call's output,
        # zeroed (padding rows are never written, and stay finite), and the smaller sizes write into
        # the front of the same buffers.
        if len(self.outs) == len(self.calls):
            self.outs.append(torch.zeros(q.shape, dtype=q.dtype, device=q.device))
        out = self.outs[len(self.calls)][:q.shape[0]]
        self.calls.append((spec, q, k, v, kv_cache, rotary, out))
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.pieces.append(graph)
        return out


class PiecewiseGraphs:
    @torch.inference_mode()
    def __init__(self, model: torch.nn.Module, backend, device: torch.device, max_tokens: int, block_size: int,
                 scratch_slot: int, pool, stream: torch.cuda.Stream) -> None:
        assert isinstance(backend, CudaAttentionBackend)   # its K/V write reads md.slots, which run() pads
        self.backend = backend
        self.sizes = token_ladder(LADDER, max_tokens)
        self.tokens = StaticTokens(self.sizes[-1], scratch_slot, device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.calls: dict[int, list[tuple]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        outs: list[torch.Tensor] = []   # attention outputs, one per layer, shared by all sizes
        before, t0 = torch.cuda.memory_allocated(device), time.perf_counter()
        side = torch.cuda.Stream(device)
        # Warm-up metadata: one padding request with no queries, so attention reads and stores nothing.
        idle = PrefillTiles(torch.from_numpy(tiles_data([], [], [], 1, 1)).to(device), 1, 1,
                            torch.zeros(1, 1, dtype=torch.int32, device=device))
        for size in reversed(self.sizes):   # largest first: the smaller graphs reuse its memory
            warm = AttentionContext(backend, prefill_metadata(self.tokens.slots[:size], idle, block_size))
            self.tokens.warm_up(model, size, warm, side)
            # As torch.cuda.graph does: nothing in flight, the warm-up's cached blocks released, and
            # the capture on the stream the other graphs used (the pool's blocks belong to a stream).
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            with torch.cuda.stream(stream):
                pieces, calls = [torch.cuda.CUDAGraph()], []
                ctx = AttentionContext(_Split(backend, pieces, calls, outs, pool), None)
                pieces[0].capture_begin(pool=pool)
                self.outputs[size] = self.tokens.forward(model, size, ctx)
                pieces[-1].capture_end()
            torch.cuda.current_stream(device).wait_stream(stream)
            self.pieces[size], self.calls[size] = pieces, calls
        logger.info("Piecewise CUDA graphs captured for mixed steps, token counts %s (%d pieces each, "
                    "%.2f GiB, %.1f s)", self.sizes, len(self.pieces[self.sizes[-1]]),
                    (torch.cuda.memory_allocated(device) - before) / 2**30, time.perf_counter() - t0)

    def fits(self, attn: CommonAttentionMetadata) -> bool:
        return len(attn.query_lens) > attn.num_decodes and sum(attn.query_lens) <= self.sizes[-1]

    def run(self, columns: torch.Tensor, attn: CommonAttentionMetadata) -> torch.Tensor:
        """Hidden states of a step with at least one prefill chunk that fits() (columns: StaticTokens.load's)."""
        t = columns.shape[1]
        size = next(s for s in self.sizes if s >= t)
        self.tokens.load(columns, size)
        md = self.backend.build(attn, columns.device)
        md.slots = self.tokens.slots[:size]   # the K/V write covers the padding rows too (into the scratch slot)
        pieces = self.pieces[size]
        for piece, (spec, q, k, v, kv_cache, rotary, out) in zip(pieces, self.calls[size]):
            piece.replay()
            self.backend.forward(spec, q, k, v, kv_cache, md, rotary, out)
        pieces[-1].replay()
        return self.outputs[size][:t]
