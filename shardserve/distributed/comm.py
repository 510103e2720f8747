"""The only module that calls collectives. With one rank every collective is the identity."""
from __future__ import annotations

import torch

from shardserve.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    import torch.distributed as dist
    dist.all_reduce(x, group=tp.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)
