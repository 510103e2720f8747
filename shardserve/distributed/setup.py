"""Setting a rank's distributed state up and tearing it down: the process groups
(parallel_state.py), then the fast all-reduce paths built on them (comm.py). Above both, so neither
imports the other to do it."""
from __future__ import annotations

import torch

from shardserve.distributed import comm
from shardserve.distributed.parallel_state import destroy_groups, init_groups


def init_distributed(rank: int, tp_size: int, pp_size: int, init_method: str, device: torch.device,
                     timeout_s: float = 120.0, fast_all_reduce: bool = True,
                     enable_expert_parallel: bool = False, dp_size: int = 1, dp_rank: int = 0) -> None:
    """Join the engine's process group and build the TP and PP groups (parallel_state.init_groups
    says which with expert parallelism across replicas). Every rank calls this.
    fast_all_reduce: small TP all-reduces on GPUs of one host go one-shot over symmetric memory
    (distributed/comm.py) rather than through NCCL."""
    init_groups(rank, tp_size, pp_size, init_method, device, timeout_s, enable_expert_parallel, dp_size, dp_rank)
    comm.init_fast_all_reduce(device if fast_all_reduce else None)


def destroy_distributed() -> None:
    comm.init_fast_all_reduce(None)
    destroy_groups()
