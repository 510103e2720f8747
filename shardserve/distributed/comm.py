"""The only module that calls collectives. With one rank in a group every call is the identity."""
from __future__ import annotations

import logging
import os
import socket

import torch

from shardserve.distributed.parallel_state import GroupInfo, get_dp_group, get_pp_group, get_tp_group

logger = logging.getLogger("shardserve")


class OneShotAllReduce:
    """Small TP all-reduces over torch symmetric memory: every rank copies its input into a buffer
    its peers can read over NVLink, and one kernel sums all ranks' buffers (the `one_shot` op, with
    its own barriers). A decode step's all-reduces are a few KiB, where NCCL's per-call cost
    dominates: measured inside a CUDA graph on two H200s, 7.4 us against NCCL's 16.1 us for 8 KiB.
    Larger messages, and TP groups that span hosts, stay on NCCL."""

    MAX_BYTES = 1 << 20

    def __init__(self, tp: GroupInfo, device: torch.device) -> None:
        self.group_name, self.device = tp.group.group_name, device
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.copy_in_kernel = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")

    @staticmethod
    def create(tp: GroupInfo, device: torch.device) -> "OneShotAllReduce | None":
        """Every TP rank calls this (it is a collective); None where the fast path cannot run."""
        import torch.distributed as dist
        if (tp.world_size == 1 or device.type != "cuda" or os.environ.get("SHARDSERVE_ONE_SHOT_ALLREDUCE") == "0"
                or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out")):
            return None
        hosts: list[str | None] = [None] * tp.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=tp.group)
        if len(set(hosts)) != 1:
            return None
        return OneShotAllReduce(tp, device)

    def handles(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.is_contiguous() and x.numel() * x.element_size() <= self.MAX_BYTES

    def __call__(self, x: torch.Tensor) -> None:
        buffer = self.buffers.get(x.dtype)
        if buffer is None:   # first call per dtype: an eager warm-up on every rank, never inside a capture
            import torch.distributed._symmetric_memory as symm_mem
            buffer = symm_mem.empty(self.MAX_BYTES // x.element_size(), dtype=x.dtype, device=self.device)
            symm_mem.rendezvous(buffer, self.group_name)
            self.buffers[x.dtype] = buffer
        flat = x.view(-1)
        staged = buffer[:flat.numel()]
        if self.copy_in_kernel:   # the reduction kernel stages the input itself: one launch, not two
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, flat)
            return
        staged.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)


_ONE_SHOT: OneShotAllReduce | None = None
_FUSED_NORM = None   # fused_allreduce.AllReduceAddRMSNorm where it can run


def init_fast_all_reduce(device: torch.device | None) -> None:
    """After the groups exist, on every rank: set up the one-shot path for TP all-reduces and the
    fused all-reduce + add + norm for decode rows (None: NCCL/gloo only, as after the groups are
    destroyed)."""
    global _ONE_SHOT, _FUSED_NORM
    _ONE_SHOT = OneShotAllReduce.create(get_tp_group(), device) if device is not None else None
    _FUSED_NORM = None
    if _ONE_SHOT is not None:
        logger.info("TP all-reduces up to %d KiB: one-shot over symmetric memory", OneShotAllReduce.MAX_BYTES >> 10)
        from shardserve.distributed.fused_allreduce import AllReduceAddRMSNorm
        _FUSED_NORM = AllReduceAddRMSNorm.create(get_tp_group(), device)


def fused_all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float) -> torch.Tensor | None:
    """rmsnorm(allreduce(x) + residual) * weight in one kernel, residual updated in place; None
    where the fused path does not take these tensors (the caller reduces, then norms)."""
    if _FUSED_NORM is None:
        return None
    if not _FUSED_NORM.handles(x, residual):
        _FUSED_NORM.check_no_pending()
        return None
    return _FUSED_NORM(x, residual, weight, eps)


def partial_sum_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight^T for a row-parallel layer whose partial sum the next RMSNorm(partial_sum=True)
    all-reduces: where the fused path runs, the matmul exchanges the sum's parts with the peers
    itself (fused_allreduce.AllReduceAddRMSNorm.matmul). None where it does not (use the plain matmul)."""
    return _FUSED_NORM.matmul(x, weight) if _FUSED_NORM is not None else None


def take_reduced(x: torch.Tensor) -> bool:
    """Whether x is partial_sum_matmul()'s output already all-reduced in the matmul (the norm then
    only adds and norms)."""
    return _FUSED_NORM is not None and _FUSED_NORM.take_reduced(x)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    if _FUSED_NORM is not None:
        _FUSED_NORM.check_no_pending()
    if _ONE_SHOT is not None and _ONE_SHOT.handles(x):
        _ONE_SHOT(x)
        return x
    gathered_bytes = x.numel() * x.element_size() * tp.world_size
    if x.device.type == "cpu" and x.is_contiguous() and gathered_bytes <= GATHER_SUM_MAX_BYTES:
        # Gloo's all_reduce costs 1.5-2.5 ms for a few KiB between two processes of a 2-core
        # machine; gathering the parts and summing them here costs 0.3-0.8 ms (up to 512 KiB;
        # equal near 2 MiB). Every rank sums the same parts in rank order, so all get the same bits.
        parts = _all_gather_flat(x, tp)
        torch.sum(parts.view((tp.world_size,) + x.shape), 0, out=x)
        return x
    import torch.distributed as dist
    x = x.contiguous()   # NCCL and gloo take contiguous tensors only (a no-op for the usual ones)
    dist.all_reduce(x, group=tp.group)
    return x


GATHER_SUM_MAX_BYTES = 1 << 20   # CPU all-reduces up to this many gathered bytes: all-gather + local sum


def _all_gather_flat(x: torch.Tensor, tp: GroupInfo) -> torch.Tensor:
    """The ranks' x stacked along dim 0 in rank order, in one buffer [world * x.shape[0], ...]."""
    import torch.distributed as dist
    out = torch.empty((tp.world_size * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    # all_gather_into_tensor is deprecated from torch 2.13 on (a FutureWarning per call) in favour
    # of all_gather_single, which older releases (the GPU machines' 2.11) do not have.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous(), group=tp.group)
    return out


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    # One buffer with the ranks' parts stacked along dim 0, then a view with them side by side in
    # `dim`: for one row (batch-1 decode logits) no copy at all, where a list of parts would need
    # copying out of the collective's buffer and concatenating.
    out = _all_gather_flat(x, tp)
    d = dim % x.dim()
    return out.view((tp.world_size,) + x.shape).movedim(0, d).flatten(d, d + 1)


def dp_gather_tokens(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """A MoE layer's dispatch when the experts span data-parallel replicas: every replica's rows of
    x [tokens, hidden] stacked in replica order, and how many rows each replica has (replicas batch
    different requests, so the counts differ; the exchange pads to the largest)."""
    dp = get_dp_group()
    counts = _all_gather_flat(torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device), dp).tolist()
    most = max(counts)
    padded = x.new_zeros((most,) + x.shape[1:])
    padded[:x.shape[0]] = x
    stacked = _all_gather_flat(padded, dp)
    return torch.cat([stacked[d * most:d * most + n] for d, n in enumerate(counts)]), counts


def dp_reduce_scatter_tokens(out: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The combine that undoes dp_gather_tokens: every replica's `out` (its experts' partial sums for
    all replicas' rows) summed, and this replica's rows returned."""
    import torch.distributed as dist
    dp = get_dp_group()
    most = max(counts)
    padded = out.new_zeros((dp.world_size * most,) + out.shape[1:])
    start = 0
    for d, n in enumerate(counts):
        padded[d * most:d * most + n] = out[start:start + n]
        start += n
    if out.is_cuda:
        mine = out.new_empty((most,) + out.shape[1:])
        dist.reduce_scatter_tensor(mine, padded, group=dp.group)
    else:   # gloo has no reduce-scatter
        dist.all_reduce(padded, group=dp.group)
        mine = padded[dp.rank * most:(dp.rank + 1) * most]
    return mine[:counts[dp.rank]]


def pp_send_next(tensors: list[torch.Tensor]) -> None:
    """Hand activations to the next pipeline stage (same TP rank)."""
    import torch.distributed as dist
    pp = get_pp_group()
    for t in tensors:
        dist.send(t.contiguous(), dst=pp.ranks[pp.rank + 1], group=pp.group)


def pp_recv_prev(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Receive activations from the previous pipeline stage; shapes are known from the step."""
    import torch.distributed as dist
    pp = get_pp_group()
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=pp.ranks[pp.rank - 1], group=pp.group)
        out.append(t)
    return out
