"""The fused TP all-reduce + residual add + RMSNorm for decode rows on one host: the symmetric-memory
exchange buffers, their use counts, and the bookkeeping between the row-parallel matmul that starts
the exchange and the norm that finishes it. The kernels and the protocol they follow are described
in kernels/allreduce/triton_allreduce.py.

On by default for TP groups of two (the size tested on GPUs so far; the kernel itself takes any
group of one host): SHARDSERVE_FUSED_ALLREDUCE=1 turns it on for larger groups, =0 off (the
one-shot all-reduce, then the norm kernel). Tests: bit for bit against the separate kernels (40
chained calls, eager and replayed from a graph, with and without the matmul sending), and the 8B
TP=2 model's greedy tokens against both the separate path and all-NCCL all-reduces
(tests/gpu/test_cuda_parallel.py).
"""
from __future__ import annotations

import os

import torch

from shardserve.distributed.parallel_state import GroupInfo
from shardserve.kernels import triton_ops
from shardserve.kernels.allreduce.triton_allreduce import (
    MAX_HIDDEN,
    MAX_ROWS,
    MAX_STRIPS,
    NOT_LANDED,
    all_reduce_add_rms_norm,
)
from shardserve.kernels.gemv import triton_gemv

# What the row-parallel matmul before the kernel does (A/B runs): "reduce" (the default) sums the
# partials in its epilogue, "send" only sends them, "0" neither (the kernel sends).
MATMUL_MODE = os.environ.get("SHARDSERVE_MATMUL_ALLREDUCE", "reduce")


class _Exchange:
    """A symmetric-memory buffer of 2 slots x ranks x MAX_ROWS x MAX_HIDDEN values, every rank's
    address of it, and `counters` use counts that pick the slot."""

    def __init__(self, tp: GroupInfo, device: torch.device, counters: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.buffer = symm_mem.empty(2 * tp.world_size * MAX_ROWS * MAX_HIDDEN, dtype=torch.int16, device=device)
        self.buffer.fill_(NOT_LANDED)
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
                               "handed to the norm (RowParallelLinear(partial_sum=True) output must go to "
                               "RMSNorm(partial_sum=True) next)")

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        sent = x is self._sent
        if not sent:
            self.check_no_pending()
        self._sent = None
        return all_reduce_add_rms_norm(x, residual, weight, eps, self.rows.peers, self.rows.calls, self.rank,
                                       self.world, sent)
