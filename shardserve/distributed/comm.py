"""The only module that calls collectives. With one rank in a group every call is the identity."""
from __future__ import annotations

import torch

from shardserve.distributed.parallel_state import get_pp_group, get_tp_group


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
