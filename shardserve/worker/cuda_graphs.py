"""CUDA graphs for decode steps: the model forward of a decode-only batch is captured once per
batch size on a ladder (1, 2, 4, 8, then every 16 up to max_num_seqs, at most 256) over static buffers;
a step copies its inputs into the buffers (padding rows to the next captured size) and replays.
Replaying one graph replaces thousands of kernel launches from Python.

Padding rows write their K/V into a scratch block past the end of the pool (allocated for this)
and read only the null block, so they touch nothing a request owns. Sampling stays outside the
graph. Prefill-only and mixed steps have graphs of their own (prefill_graphs.py,
piecewise_graphs.py); longer steps run eagerly. With TP > 1 every rank captures the same ladder and the
NCCL all-reduces inside the forward are captured too (every rank replays the same size, since all
get the same step); with PP > 1 (sends between stages) steps stay eager.
"""
from __future__ import annotations

import logging
import time

import torch

from shardserve.layers.attention import AttentionContext
from shardserve.layers.attention.cuda_backend import decode_metadata

logger = logging.getLogger("shardserve")


MAX_GRAPH_BATCH = 256   # bounds start-up capture time; larger decode batches run eagerly


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def token_ladder(ladder: tuple[int, ...], max_tokens: int) -> list[int]:
    """The ladder's sizes below max_tokens, topped by max_tokens itself (at most the ladder's top)."""
    return sorted({s for s in ladder if s < max_tokens} | {min(max_tokens, ladder[-1])})


class StaticTokens:
    """A graph's per-token inputs: token ids, positions and KV slots for up to n tokens. A step's
    tokens fill the front; the padding up to the replayed size writes its K/V into the scratch slot."""

    def __init__(self, n: int, scratch_slot: int, device: torch.device) -> None:
        self.scratch_slot = scratch_slot
        # The three as rows of one buffer: a step's inputs, rows of one tensor too (StepInputs.token_columns),
        # come in one copy (each copy between two replays costs the batch-1 step 2-3 us).
        self.columns = torch.zeros(3, n, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slots = self.columns
        self.slots.fill_(scratch_slot)

    def load(self, columns: torch.Tensor, size: int) -> None:
        """A step's token ids, positions and KV slots (the rows of `columns` [3, t], StepInputs.token_columns)
        in front, padding up to `size`."""
        t = columns.shape[1]
        self.columns[:, :t].copy_(columns, non_blocking=True)
        self.slots[t:size].fill_(self.scratch_slot)

    def forward(self, model: torch.nn.Module, size: int, ctx: AttentionContext) -> torch.Tensor:
        return model(self.input_ids[:size], self.positions[:size], ctx)

    def warm_up(self, model: torch.nn.Module, size: int, ctx: AttentionContext, side: torch.cuda.Stream) -> None:
        """One forward on the side stream before a capture: compiles kernels, settles the allocator."""
        current = torch.cuda.current_stream(side.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.forward(model, size, ctx)
        current.wait_stream(side)

    def capture(self, model: torch.nn.Module, size: int, ctx: AttentionContext, side: torch.cuda.Stream, pool,
                stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The forward of `size` tokens as a graph (warmed up first), and its output tensor."""
        self.warm_up(model, size, ctx, side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = self.forward(model, size, ctx)
        return graph, out


class DecodeGraphs:
    @torch.inference_mode()
    def __init__(self, model: torch.nn.Module, backend, device: torch.device, max_batch: int, max_blocks: int,
                 block_size: int, scratch_slot: int, pool, stream: torch.cuda.Stream) -> None:
        self.sizes = batch_ladder(min(max_batch, MAX_GRAPH_BATCH))
        n = self.sizes[-1]
        self.tokens = StaticTokens(n, scratch_slot, device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        before, t0 = torch.cuda.memory_allocated(device), time.perf_counter()
        side = torch.cuda.Stream(device)   # one warm-up stream: its cached memory is shared by all sizes
        for batch in reversed(self.sizes):   # largest first: the smaller graphs reuse its memory
            md = decode_metadata(self.tokens.slots[:batch], self.block_tables[:batch], self.seq_lens[:batch],
                                 block_size)
            self.graphs[batch], self.outputs[batch] = self.tokens.capture(model, batch, AttentionContext(backend, md),
                                                                          side, pool, stream)
        logger.info("CUDA graphs captured for decode batches %s (%.2f GiB, %.1f s)", self.sizes,
                    (torch.cuda.memory_allocated(device) - before) / 2**30, time.perf_counter() - t0)

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def run(self, columns: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Hidden states of a decode-only batch (one token per request; columns: StaticTokens.load's)."""
        b = columns.shape[1]
        batch = next(s for s in self.sizes if s >= b)
        self.tokens.load(columns, batch)
        self.block_tables[:batch].zero_()
        self.block_tables[:b, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.seq_lens[:b].copy_(seq_lens, non_blocking=True)
        self.seq_lens[b:batch].fill_(1)
        self.graphs[batch].replay()
        return self.outputs[batch][:b]
