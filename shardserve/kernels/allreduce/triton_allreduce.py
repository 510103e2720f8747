"""A decode step's `all-reduce -> residual add -> RMSNorm` as one Triton kernel, for TP ranks on one
host (the buffers, the group and the matmul that feeds it: distributed/fused_allreduce.py).

Each TP layer ends in a row-parallel matmul whose partial sums are all-reduced and then normed with
the residual. Done apart, that is two launches (the one-shot all-reduce with its two cross-GPU
barriers, then the norm) for a few KiB. Here one kernel does both, and needs no barrier at all:

- Every rank stores its partial row straight into each peer's buffer over NVLink (symmetric
  memory), then reads its own buffer until every rank's values have landed. "Not landed yet" is
  one bit pattern: negative zero, which senders write as +0.0 (the same number), so a reader can
  wait on each element alone, with no flag to order against the data ("Lamport" style).
- After reading, a rank puts the pattern back into its buffer, ready for the next use.
- A rank's own part never goes through its buffer: the kernel adds it from x as it would arrive.
- The exchange can start earlier, in the epilogue of the skinny matmul that makes the partial sum
  (`matmul()`, used by RowParallelLinear(partial_sum=True)), so values cross NVLink as each matmul
  program finishes instead of after the matmul and this kernel's launch. Mode "send": the matmul
  sends, this kernel waits and sums (8B TP=2 graph replay on two H200s: 2.50 -> 2.46 ms). Mode
  "reduce" (the default): each matmul program also waits for the peers' values of its strip and
  writes the finished sum, and the norm that follows is the plain add + norm kernel. That needs
  every program of the matmul running at once (a program waits for its twin on each peer, which
  must not be queued behind waiting programs), so only matmuls of at most one program per SM
  take it; the programs count their own uses in a buffer of their own.
- Two buffer slots alternate between consecutive uses of a row: a peer can run at most one use
  ahead (the use after that needs this rank's next values), so it never writes into the slot this
  rank is still reading or resetting. Each row counts its own uses on the device (ranks run the
  same batches, so their counts agree), so no program waits on another and CUDA graphs keep the
  counts.
- Sums are taken in fp32 in rank order, the same on every rank (TP ranks must hold identical
  hidden states); with two ranks that is exactly the sum NCCL and the one-shot kernel give. The
  add and the norm are kernels/norm/triton_norm.py's own helper at its warp count (which sets the order
  the sum of squares is reduced in), so the result is bit-identical to the separate all-reduce
  and norm.

Up to MAX_ROWS rows (a decode batch; larger batches take the separate path) and MAX_HIDDEN
features.
"""
from __future__ import annotations

import functools

import torch

from shardserve.kernels import pdl
from shardserve.kernels.norm import triton_norm

MAX_ROWS = 16
MAX_HIDDEN = 16384
MAX_STRIPS = MAX_HIDDEN // 16   # matmul programs (output strips of 32 or 64 features; 16 with room)
NOT_LANDED = -32768   # 0x8000 as int16: negative zero in bf16 and fp16


@functools.cache
def exchange_fns():
    """The jit helpers both kernels use: send_to_peers stores this rank's part into every peer's
    buffer; sum_with_peers waits for the peers' parts and returns the fp32 sum in rank order."""
    import triton
    import triton.language as tl

    @triton.jit
    def _as_sent(y):
        """y's bits as sent: -0.0 becomes +0.0 (the same number), so the pattern stays free."""
        bits = y.to(tl.int16, bitcast=True)
        return tl.where(bits == -32768, tl.zeros_like(bits), bits)

    @triton.jit
    def send_to_peers(y, peers_ptr, rank, row, slot, cols, mask, WORLD: tl.constexpr, MAX_ROWS: tl.constexpr,
                      MAX_HIDDEN: tl.constexpr):
        """y (bf16/fp16, any shape) is this rank's part of `row` at `cols`, for the use in `slot`."""
        bits = _as_sent(y)
        mine = ((slot * WORLD + rank) * MAX_ROWS + row) * MAX_HIDDEN + cols
        for p in tl.static_range(WORLD):
            peer = tl.load(peers_ptr + p).to(tl.pointer_type(tl.int16))
            tl.store(peer + mine, bits, mask=mask & (p != rank))

    @triton.jit
    def sum_with_peers(y, peers_ptr, rank, row, slot, cols, mask, WORLD: tl.constexpr, MAX_ROWS: tl.constexpr,
                       MAX_HIDDEN: tl.constexpr):
        """This rank's part y plus every peer's, in rank order (the same sum on every rank), each
        peer's read from this rank's buffer once it has landed there; then the pattern goes back."""
        own = tl.load(peers_ptr + rank).to(tl.pointer_type(tl.int16))
        acc = tl.zeros_like(y).to(tl.float32)
        for p in tl.static_range(WORLD):
            if p == rank:
                v = _as_sent(y)
            else:
                theirs = own + ((slot * WORLD + p) * MAX_ROWS + row) * MAX_HIDDEN + cols
                v = tl.load(theirs, mask=mask, other=0, volatile=True)
                while tl.sum(tl.ravel((v == -32768).to(tl.int32)), axis=0) > 0:
                    v = tl.load(theirs, mask=mask, other=0, volatile=True)
                tl.store(theirs, tl.full(v.shape, -32768, tl.int16), mask=mask)
            acc += v.to(y.dtype, bitcast=True).to(tl.float32)
        return acc

    return send_to_peers, sum_with_peers


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    add_rms_norm = triton_norm._kernels().add_rms_norm
    send_to_peers, sum_with_peers = exchange_fns()

    @triton.jit
    def all_reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, peers_ptr, calls_ptr, rank, n_cols,
                                       eps, WORLD: tl.constexpr, MAX_ROWS: tl.constexpr,
                                       MAX_HIDDEN: tl.constexpr, BLOCK: tl.constexpr, SENT: tl.constexpr,
                                       PDL: tl.constexpr):
        pdl.start(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        call = tl.load(calls_ptr + row, volatile=True)   # this row's own count: no program waits on another
        slot = call % 2
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if not SENT:   # SENT: the matmul that made x already sent it to the peers
            send_to_peers(x, peers_ptr, rank, row, slot, cols, mask, WORLD, MAX_ROWS, MAX_HIDDEN)
        # The residual and the norm weight do not depend on the peers: their loads overlap the wait.
        res = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        acc = sum_with_peers(x, peers_ptr, rank, row, slot, cols, mask, WORLD, MAX_ROWS, MAX_HIDDEN)
        # residual = allreduce(x) + residual, then the norm: the code triton_ops.rms_norm runs
        add_rms_norm(acc.to(x.dtype), res, w, res_ptr, out_ptr, row, cols, mask, n_cols, eps, HAS_RES=True)
        tl.store(calls_ptr + row, call + 1)

    return triton, all_reduce_add_rms_norm_kernel


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            peers: torch.Tensor, calls: torch.Tensor, rank: int, world: int,
                            sent: bool) -> torch.Tensor:
    """rmsnorm(sum over ranks of x + residual) * weight; residual updated in place. peers: every
    rank's exchange buffer address; calls: this kernel's per-row use counts; sent: x's values were
    already sent to the peers by the matmul that made them."""
    triton, kernel = _kernel()
    rows, n = x.shape
    out = torch.empty_like(x)
    kernel[(rows,)](x, residual, weight, out, peers, calls, rank, n, eps,
                    WORLD=world, MAX_ROWS=MAX_ROWS, MAX_HIDDEN=MAX_HIDDEN,
                    BLOCK=triton.next_power_of_2(n), SENT=sent, num_warps=triton_norm.NORM_WARPS,
                    **pdl.launch_args(x))
    return out
