"""A decode step's `all-reduce -> residual add -> RMSNorm` as one kernel, for TP ranks on one host.

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
  (`matmul()`, used by RowParallelLinear(reduce=False)), so values cross NVLink as each matmul
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
MAX_STRIPS = MAX_HIDDEN // 16   # matmul programs (output strips of 32 or 64 features; 16 with room)
_NOT_LANDED = -32768   # 0x8000 as int16: negative zero in bf16 and fp16
# What the row-parallel matmul before the kernel does (A/B runs): "reduce" (the default) sums the
# partials in its epilogue, "send" only sends them, "0" neither (the kernel sends).
MATMUL_MODE = os.environ.get("SHARDSERVE_MATMUL_ALLREDUCE", "reduce")


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

    add_rms_norm = triton_ops._kernels().add_rms_norm
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


class _Exchange:
    """A symmetric-memory buffer of 2 slots x ranks x MAX_ROWS x MAX_HIDDEN values, every rank's
    address of it, and `counters` use counts that pick the slot."""

    def __init__(self, tp: GroupInfo, device: torch.device, counters: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.buffer = symm_mem.empty(2 * tp.world_size * MAX_ROWS * MAX_HIDDEN, dtype=torch.int16, device=device)
        self.buffer.fill_(_NOT_LANDED)
        handle = symm_mem.rendezvous(self.buffer, tp.group.group_name)
        self.peers = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.calls = torch.zeros(counters, dtype=torch.int32, device=device)


class AllReduceAddRMSNorm:
    """rmsnorm(allreduce(x) + residual) * weight in one kernel; residual is updated in place."""

    def __init__(self, tp: GroupInfo, device: torch.device) -> None:
        import torch.distributed as dist
        self.world, self.rank = tp.world_size, tp.rank
        self.rows = _Exchange(tp, device, MAX_ROWS)   # this kernel's: a count per row
        # the matmul's that sums in its epilogue: a count per (program, row), since its programs
        # each read their own count and no program may advance another's
        self.strips = _Exchange(tp, device, MAX_STRIPS * MAX_ROWS)
        self.programs_at_once = torch.cuda.get_device_properties(device).multi_processor_count
        self._sent: torch.Tensor | None = None   # matmul()'s output, already in the peers' buffers
        self._reduced: torch.Tensor | None = None   # matmul()'s output, already all-reduced
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
        """x @ weight^T for a row-parallel partial sum that the next call all-reduces, with the
        exchange begun (or done) in the skinny matmul's epilogue:
        - "reduce": each matmul program sends its strip of outputs to the peers, waits for theirs
          and stores the sum; the next call is then the plain add + norm. Only where all the
          matmul's programs run at once (one per SM): a program waits for the same program on the
          peers, which must not be queued behind it.
        - "send": the programs send their strips; the next call only waits and sums.
        None where the matmul kernel does not take x (the caller uses the plain matmul)."""
        if MATMUL_MODE == "0" or not (triton_gemv.handles(x, weight) and x.shape[0] <= MAX_ROWS
                                      and weight.shape[0] <= MAX_HIDDEN):
            return None
        self.check_no_pending()
        reduce = MATMUL_MODE == "reduce" and triton_gemv.programs(weight) <= self.programs_at_once
        ex = self.strips if reduce else self.rows
        out = triton_gemv.gemv(x, weight, send=dict(peers_ptr=ex.peers, calls_ptr=ex.calls, rank=self.rank,
                                                    WORLD=self.world, SEND_ROWS=MAX_ROWS, SEND_HIDDEN=MAX_HIDDEN,
                                                    REDUCE=reduce))
        if reduce:
            self._reduced = out
        else:
            self._sent = out
        return out

    def take_reduced(self, x: torch.Tensor) -> bool:
        """Whether x came from matmul() already all-reduced (the caller only adds and norms)."""
        if x is not self._reduced:
            return False
        self._reduced = None
        return True

    def check_no_pending(self) -> None:
        """A partial sum sent to the peers must be the next thing this all-reduces (a slot written
        and never read would hand its stale values to a later call), and one already reduced must
        not be reduced again."""
        if self._sent is not None or self._reduced is not None:
            raise RuntimeError("a row-parallel matmul's output was exchanged with the TP peers but not "
                               "handed to the norm (RowParallelLinear(reduce=False) output must go to "
                               "RMSNorm(reduce=True) next)")

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        triton, kernel = _kernel()
        sent = x is self._sent
        if not sent:
            self.check_no_pending()
        self._sent = None
        rows, n = x.shape
        out = torch.empty_like(x)
        kernel[(rows,)](x, residual, weight, out, self.rows.peers, self.rows.calls, self.rank, n, eps,
                        WORLD=self.world, MAX_ROWS=MAX_ROWS, MAX_HIDDEN=MAX_HIDDEN,
                        BLOCK=triton.next_power_of_2(n), SENT=sent, num_warps=triton_ops.NORM_WARPS,
                        **pdl.launch_args(x))
        return out
