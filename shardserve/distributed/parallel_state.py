"""Who am I in the parallel layout, and the process groups that go with it.

Rank layout inside one engine (one data-parallel replica): rank = pp_rank * tp_size + tp_rank,
so a tensor-parallel group is a run of consecutive ranks (inside one node when TP <= GPUs per
node) and pipeline stages stride across them (across nodes). Layers ask this module, never
torch.distributed directly, so a single-device run needs no process group at all.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupInfo:
    rank: int = 0                  # rank inside the group
    world_size: int = 1
    ranks: tuple[int, ...] = (0,)  # global ranks of the group, in group order
    group: object | None = None    # a torch.distributed ProcessGroup when world_size > 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


_TP = GroupInfo()
_PP = GroupInfo()
_WORLD = GroupInfo()
_EP = GroupInfo()   # the ranks that split a MoE layer's experts; size 1 without expert parallelism
_DP = GroupInfo()   # the same stage and TP rank in every replica; size > 1 only when EP spans replicas
_PP_PARTITION: tuple[int, ...] | None = None   # layers per stage; None = as even as possible


def get_tp_group() -> GroupInfo:
    return _TP


def get_pp_group() -> GroupInfo:
    return _PP


def get_world_group() -> GroupInfo:
    return _WORLD


def get_ep_group() -> GroupInfo:
    return _EP


def get_dp_group() -> GroupInfo:
    return _DP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def set_pp_partition(partition: tuple[int, ...] | None) -> None:
    global _PP_PARTITION
    _PP_PARTITION = partition


def pp_layer_partition(num_layers: int, pp_size: int, partition: tuple[int, ...] | None = None) -> list[int]:
    """Layers per stage: the explicit partition, or an even split with the remainder going to the
    earlier stages (the last stage also carries the LM head)."""
    if partition is not None:
        if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(f"pipeline partition {list(partition)} must have {pp_size} positive entries "
                             f"summing to the model's {num_layers} layers")
        return list(partition)
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if i < extra else 0) for i in range(pp_size)]


def get_pp_layer_range(num_layers: int) -> tuple[int, int]:
    """[start, end) of the layers this pipeline stage owns."""
    sizes = pp_layer_partition(num_layers, _PP.world_size, _PP_PARTITION)
    start = sum(sizes[:_PP.rank])
    return start, start + sizes[_PP.rank]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# init_method scheme for a rendezvous store that is already up (host_store) and that every rank,
# rank 0 included, joins as a client. torch's own "tcp://" makes rank 0 bind the port itself.
HOSTED_STORE = "store://"


def host_store(world: int, timeout_s: float = 120.0, host: str = "127.0.0.1"):
    """Start the ranks' rendezvous store in this process on a port the OS picks. Returns the store
    (keep it alive until the ranks exit) and the init_method that joins it at `host` (this
    machine's address as the ranks see it; the store listens on every interface). Picking a free
    port and letting rank 0 bind it later races: in between, any outgoing connection on the host
    may be given that port (the ranks' own connections included), and rank 0 then fails with
    EADDRINUSE."""
    import torch.distributed as dist
    store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, f"{HOSTED_STORE}{host}:{store.port}"


def _join_world(rank: int, world: int, init_method: str, device: torch.device, timeout: datetime.timedelta) -> None:
    import torch.distributed as dist
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if init_method.startswith(HOSTED_STORE):
        host, port = init_method[len(HOSTED_STORE):].rsplit(":", 1)
        kwargs["store"] = dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout)
    else:
        kwargs["init_method"] = init_method
    dist.init_process_group(backend_for(device), rank=rank, world_size=world, timeout=timeout, **kwargs)


def init_groups(rank: int, tp_size: int, pp_size: int, init_method: str, device: torch.device,
                timeout_s: float = 120.0, enable_expert_parallel: bool = False, dp_size: int = 1,
                dp_rank: int = 0) -> None:
    """Join the process group and build the TP and PP groups of this engine replica, and with
    expert parallelism the EP group. Every rank calls this (through distributed/setup.py's
    init_distributed). `rank` is the rank inside the replica.

    dp_size > 1 (expert parallelism spanning data-parallel replicas): the replicas' ranks form one
    world, replica d's ranks numbered from d * tp_size * pp_size; the EP group of a pipeline stage
    is every replica's TP group of that stage (EP rank = d * tp_size + tp_rank), and the DP group
    joins the ranks that share a stage and TP rank across replicas (a MoE layer's token exchange)."""
    import torch.distributed as dist
    global _TP, _PP, _WORLD, _EP, _DP
    per_replica = tp_size * pp_size
    world, offset = per_replica * dp_size, dp_rank * per_replica
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        _join_world(offset + rank, world, init_method, device, timeout)
    except Exception as e:   # name who could not reach whom, never a bare hang or stack trace
        raise RuntimeError(f"rank {offset + rank} of {world} could not join the process group at {init_method} "
                           f"within {timeout_s:.0f} s: {e}") from e
    _WORLD = GroupInfo(offset + rank, world, tuple(range(world)), dist.group.WORLD)
    tp_rank, pp_rank = rank % tp_size, rank // tp_size

    def build(ranks: tuple[int, ...], mine: bool, my_rank: int) -> GroupInfo | None:
        # new_group must be called by every rank for every group, in the same order.
        group = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
        return GroupInfo(my_rank, len(ranks), ranks, group) if mine else None

    def global_rank(d: int, p: int, t: int) -> int:
        return d * per_replica + p * tp_size + t

    for d in range(dp_size):
        for p in range(pp_size):
            info = build(tuple(global_rank(d, p, t) for t in range(tp_size)), (d, p) == (dp_rank, pp_rank), tp_rank)
            _TP = info or _TP
        for t in range(tp_size):
            info = build(tuple(global_rank(d, p, t) for p in range(pp_size)), (d, t) == (dp_rank, tp_rank), pp_rank)
            _PP = info or _PP
    _EP, _DP = (_TP if enable_expert_parallel else GroupInfo()), GroupInfo()
    if dp_size > 1:
        for p in range(pp_size):
            ranks = tuple(global_rank(d, p, t) for d in range(dp_size) for t in range(tp_size))
            _EP = build(ranks, p == pp_rank, dp_rank * tp_size + tp_rank) or _EP
        for p in range(pp_size):
            for t in range(tp_size):
                ranks = tuple(global_rank(d, p, t) for d in range(dp_size))
                _DP = build(ranks, (p, t) == (pp_rank, tp_rank), dp_rank) or _DP


def destroy_groups() -> None:
    import torch.distributed as dist
    global _TP, _PP, _WORLD, _EP, _DP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP, _PP, _WORLD, _EP, _DP = GroupInfo(), GroupInfo(), GroupInfo(), GroupInfo(), GroupInfo()
