"""A decode step's `all-reduce -> residual add -> RMSNorm` as one kernel, for TP ranks on one host.

Each TP layer ends in a row-parallel matmul whose partial sums are all-reduced and then normed with
the residual. Done apart, that is two launches (the one-shot all-reduce with its two cross-GPU
barriers, then the norm) for a few KiB. Here one kernel does both, and needs no barrier at all:

- Every rank stores its partial row straight into each peer's buffer over NVLink (symmetric
  memory), then reads its own buffer until every rank's values have landed. "Not landed yet" is
  one bit pattern: negative zero, which senders write as +0.0 (the same number), so a reader can
  wait on each element alone, with no flag to order against the data ("Lamport" style).
- After reading, a rank puts the pattern back into its buffer, ready for the next use.
- The sending half can run earlier, in the epilogue of the skinny matmul that makes the partial
  sum (`matmul()`, used by RowParallelLinear(reduce=False)); the kernel then only waits. Its
  values then start crossing NVLink as each matmul program finishes instead of after the matmul
  and this kernel's launch (8B TP=2 graph replay on two H200s: 2.50 -> 2.46 ms).
- Two buffer slots alternate between consecutive uses of a row: a peer can run at most one use
  ahead (the use after that needs this rank's next values), so it never writes into the slot this
  rank is still reading or resetting. Each row counts its own uses on the device (ranks run the
  same batches, so their counts agree), so no program waits on another and CUDA graphs keep the
  counts.
- Sums are taken in fp32 in rank order, the same on every rank (TP ranks must hold identical
  hidden states); with two ranks that is exactly the sum NCCL and the one-shot kernel give. The
  add and the norm are `layers/triton_ops`'s own helper at its warp count (which sets the order
  the sum of squares is reduced in), so the result is bit-identical to the separate all-reduce
  and norm.

Up to MAX_ROWS rows (a decode batch; larger batches take the separate path) and MAX_HIDDEN
features. On by default for TP groups of two (the size tested on GPUs so far; the kernel itself
takes any group of one host): SHARDSERVE_FUSED_ALLREDUCE=1 turns it on for larger groups, =0 off
(the one-shot all-reduce, then the norm kernel). Tests: bit for bit against the separate kernels
(40 chained calls, eager and replayed from a graph, with and without the matmul sending), and the
8B TP=2 model's greedy tokens against both the separate path and all-NCCL all-reduces
(tests/gpu/test_cuda_parallel.py).
"""
from __future__ import annotations

import functools
import os

import torch

from shardserve.distributed.parallel_state import GroupInfo
from shardserve.layers import pdl, triton_gemv, triton_ops

MAX_ROWS = 16
MAX_HIDDEN = 16384
_NOT_LANDED = -32768   # 0x8000 as int16: negative zero in bf16 and fp16
SEND_FROM_MATMUL = os.environ.get("SHARDSERVE_MATMUL_SENDS", "1") != "0"   # off: the fused kernel sends (A/B runs)


@functools.cache
def store_to_peers_fn():
    """The jit helper that sends a rank's partial values into every rank's buffer: the fused
    kernel's first half, also called from the skinny matmul's epilogue (AllReduceAddRMSNorm.matmul)."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_to_peers(y, peers_ptr, rank, row, slot, cols, mask, WORLD: tl.constexpr, MAX_ROWS: tl.constexpr,
                       MAX_HIDDEN: tl.constexpr):
        """y (bf16/fp16, any shape) is this rank's part of `row` at `cols`, for the use in `slot`."""
        bits = y.to(tl.int16, bitcast=True)
        bits = tl.where(bits == -32768, tl.zeros_like(bits), bits)   # -0.0 -> +0.0: the pattern stays free
        mine = ((slot * WORLD + rank) * MAX_ROWS + row) * MAX_HIDDEN + cols
        for p in tl.static_range(WORLD):
            peer = tl.load(peers_ptr + p).to(tl.pointer_type(tl.int16))
            tl.store(peer + mine, bits, mask=mask)

    return store_to_peers


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    add_rms_norm = triton_ops._kernels().add_rms_norm
    store_to_peers = store_to_peers_fn()

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
        if not SENT:   # SENT: the matmul that made x already stored it into the peers' buffers
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
            store_to_peers(x, peers_ptr, rank, row, slot, cols, mask, WORLD, MAX_ROWS, MAX_HIDDEN)
        own = tl.load(peers_ptr + rank).to(tl.pointer_type(tl.int16))
        # The residual and the norm weight do not depend on the peers: their loads overlap the wait.
        res = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        dt = res_ptr.dtype.element_ty
        for p in tl.static_range(WORLD):   # rank order: the same sum on every rank
            theirs = own + ((slot * WORLD + p) * MAX_ROWS + row) * MAX_HIDDEN + cols
            v = tl.load(theirs, mask=mask, other=0, volatile=True)
            while tl.sum((v == -32768).to(tl.int32), axis=0) > 0:
                v = tl.load(theirs, mask=mask, other=0, volatile=True)
            acc += v.to(dt, bitcast=True).to(tl.float32)
            tl.store(theirs, tl.full([BLOCK], -32768, tl.int16), mask=mask)
        # residual = allreduce(x) + residual, then the norm: the code triton_ops.rms_norm runs
        add_rms_norm(acc.to(dt), res, w, res_ptr, out_ptr, row, cols, mask, n_cols, eps, HAS_RES=True)
        tl.store(calls_ptr + row, call + 1)

    return triton, all_reduce_add_rms_norm_kernel


class AllReduceAddRMSNorm:
    """rmsnorm(allreduce(x) + residual) * weight in one kernel; residual is updated in place."""

    def __init__(self, tp: GroupInfo, device: torch.device) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        self.world, self.rank = tp.world_size, tp.rank
        self.buffer = symm_mem.empty(2 * self.world * MAX_ROWS * MAX_HIDDEN, dtype=torch.int16, device=device)
        self.buffer.fill_(_NOT_LANDED)
        handle = symm_mem.rendezvous(self.buffer, tp.group.group_name)
        self.peers = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.calls = torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)   # calls so far, per row
        self._sent: torch.Tensor | None = None   # matmul()'s output, already in the peers' buffers
        torch.cuda.synchronize(device)
        dist.barrier(group=tp.group)   # every buffer holds the pattern before anyone writes

    @staticmethod
    def create(tp: GroupInfo, device: torch.device) -> "AllReduceAddRMSNorm | None":
        """Every TP rank calls this (it is a collective) once the one-shot path exists. On by default
        for TP groups of two, the size it has been tested at on GPUs; SHARDSERVE_FUSED_ALLREDUCE=1
        turns it on for larger groups too, =0 off. None where Triton is missing."""
        setting = os.environ.get("SHARDSERVE_FUSED_ALLREDUCE")
        if setting == "0" or (setting != "1" and tp.world_size != 2) or not triton_ops.available():
            return None
        return AllReduceAddRMSNorm(tp, device)

    def handles(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
                and x.shape[0] <= MAX_ROWS and x.shape[1] <= MAX_HIDDEN and x.is_contiguous()
                and residual.is_contiguous() and residual.dtype == x.dtype and residual.shape == x.shape)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """x @ weight^T, a row-parallel partial sum that the next call all-reduces: the skinny
        matmul also stores it into every rank's buffer from its epilogue, so that call only waits
        for the peers' rows (it skips loading x and sending it: 0.6 us of its ~4 on two H200s).
        None where the matmul kernel does not take x (the caller uses the plain matmul; the call
        then sends x)."""
        if not (SEND_FROM_MATMUL and triton_gemv.handles(x, weight) and x.shape[0] <= MAX_ROWS
                and weight.shape[0] <= MAX_HIDDEN):
            return None
        self.check_no_pending()
        self._sent = triton_gemv.gemv(x, weight, send=dict(peers_ptr=self.peers, calls_ptr=self.calls, rank=self.rank,
                                                           WORLD=self.world, SEND_ROWS=MAX_ROWS,
                                                           SEND_HIDDEN=MAX_HIDDEN))
        return self._sent

    def check_no_pending(self) -> None:
        """A partial sum already sent to the peers must be the next thing this all-reduces: a
        slot written and never read would hand its stale values to a later call."""
        if self._sent is not None:
            raise RuntimeError("a row-parallel partial sum was sent to the TP peers but not all-reduced "
                               "(RowParallelLinear(reduce=False) output must go to RMSNorm(reduce=True))")

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        triton, kernel = _kernel()
        sent = x is self._sent
        if not sent:
            self.check_no_pending()
        self._sent = None
        rows, n = x.shape
        out = torch.empty_like(x)
        kernel[(rows,)](x, residual, weight, out, self.peers, self.calls, self.rank, n, eps,
                        WORLD=self.world, MAX_ROWS=MAX_ROWS, MAX_HIDDEN=MAX_HIDDEN,
                        BLOCK=triton.next_power_of_2(n), SENT=sent, num_warps=triton_ops.NORM_WARPS,
                        **pdl.launch_args(x))
        return out
