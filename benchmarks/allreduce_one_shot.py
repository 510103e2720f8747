"""Small TP all-reduce inside a CUDA graph: the one-shot path over symmetric memory against NCCL
(issue 6), on two GPUs of one host, through the engine's own `comm.tensor_model_parallel_all_reduce`.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 benchmarks/allreduce_one_shot.py

Per mode: checks the sum equals NCCL's bit for bit, captures 64 all-reduces of 8 KiB (one decode
token's bf16 hidden state for an 8B model; 64 = two per layer) in one graph, replays it 20 times.
With the fast path on it also times what a layer really does after each all-reduce, the residual add
and RMSNorm: the one-shot kernel followed by the norm kernel, against the single fused kernel
(distributed/fused_allreduce.py, the engine's default), both captured the same way.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve.worker.graph_profile import graph_call_ms  # noqa: E402

CALLS, REPLAYS, NUMEL = 64, 20, 4096


def time_graph(fn) -> float:
    """us per call: CALLS calls of fn captured in one graph, replayed REPLAYS times (on every rank
    at once: the first, untimed replay waits for the slowest rank)."""
    return graph_call_ms(lambda i: fn(), CALLS, REPLAYS, warmups=3) * 1e3


def norm_after_all_reduce(rank: int, device: torch.device) -> None:
    from shardserve.distributed import comm
    from shardserve.kernels import triton_ops
    x = torch.randn(1, NUMEL, dtype=torch.bfloat16, device=device)
    res, w = torch.randn_like(x), torch.randn(NUMEL, dtype=torch.bfloat16, device=device)
    separate = time_graph(lambda: triton_ops.rms_norm(comm.tensor_model_parallel_all_reduce(x), w, 1e-5, res))
    fused = time_graph(lambda: comm.fused_all_reduce_add_rms_norm(x, res, w, 1e-5))
    if rank == 0:
        print(f"all-reduce + add + RMSNorm: one-shot then norm {separate:.1f} us, fused {fused:.1f} us "
              f"({separate / fused:.2f}x)", flush=True)


def worker(rank: int, fast: bool, init: str) -> None:
    from shardserve.distributed import comm
    from shardserve.distributed.setup import init_distributed
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    init_distributed(rank, 2, 1, init, device, fast_all_reduce=fast)
    x = torch.randn(NUMEL, dtype=torch.bfloat16, device=device) * (rank + 1)
    want = x.clone()
    torch.distributed.all_reduce(want)
    got = x.clone()
    comm.tensor_model_parallel_all_reduce(got)
    z = x.clone()
    us = time_graph(lambda: comm.tensor_model_parallel_all_reduce(z))
    if rank == 0:
        name = "one-shot (symmetric memory)" if comm._ONE_SHOT is not None else "NCCL"
        print(f"{name}: {us:.1f} us per 8 KiB all-reduce inside a graph; equal to NCCL's sum: {torch.equal(got, want)}",
              flush=True)
    if comm._FUSED_NORM is not None:
        norm_after_all_reduce(rank, device)
    torch.distributed.barrier()
    os._exit(0)   # no teardown: destroying NCCL / symmetric-memory state can stall; the OS frees it


if __name__ == "__main__":
    from shardserve.distributed.parallel_state import host_store
    for fast in (True, False):
        store, init = host_store(2)
        mp.spawn(worker, args=(fast, init), nprocs=2)
    print("done")
