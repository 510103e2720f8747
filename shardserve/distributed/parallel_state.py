"""Who am I in the parallel layout: tensor-parallel rank and size (pipeline and data parallel
groups join here when multi-device execution lands). Layers ask this module, never torch.distributed
directly, so a single-device run needs no process group at all."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupInfo:
    rank: int = 0
    world_size: int = 1
    group: object | None = None   # a torch.distributed ProcessGroup when world_size > 1


_TP = GroupInfo()


def get_tp_group() -> GroupInfo:
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size
