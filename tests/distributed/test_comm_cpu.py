"""The TP collectives on CPU (gloo, real processes): small all-reduces are an all-gather plus a sum
in rank order (comm.GATHER_SUM_MAX_BYTES), large ones gloo's all_reduce; both give every rank the
sum, and the gathered one gives every rank the same bits."""
from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, init: str, results) -> None:
    from shardserve.distributed import comm
    from shardserve.distributed.setup import destroy_distributed, init_distributed
    torch.set_num_threads(1)
    init_distributed(rank, world, 1, init, torch.device("cpu"))
    out = {}
    big_rows = comm.GATHER_SUM_MAX_BYTES // (world * 64 * 4) + 1   # just past the gathered path, fp32
    cases = [("small", 3, torch.float32), ("bf16", 5, torch.bfloat16), ("large", big_rows, torch.float32)]
    for name, rows, dtype in cases:
        x = (torch.randn(rows, 64, generator=torch.Generator().manual_seed(rank)) * (rank + 1)).to(dtype)
        y = x.clone()
        assert comm.tensor_model_parallel_all_reduce(y) is y
        out[name] = y
    out["gather"] = comm.tensor_model_parallel_all_gather(torch.full((2, 3), float(rank)), dim=-1)
    results[rank] = out
    destroy_distributed()


def test_cpu_all_reduce_and_all_gather_across_three_ranks():
    world = 3
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, f"tcp://127.0.0.1:{_free_port()}", results), nprocs=world)
    for name, dtype in [("small", torch.float32), ("bf16", torch.bfloat16), ("large", torch.float32)]:
        rows = results[0][name].shape[0]
        parts = [(torch.randn(rows, 64, generator=torch.Generator().manual_seed(r)) * (r + 1)).to(dtype)
                 for r in range(world)]
        want = torch.stack(parts).float().sum(0)
        for r in range(world):
            got = results[r][name]
            assert got.dtype == dtype
            rtol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            assert torch.allclose(got.float(), want, rtol=rtol, atol=1e-2), (name, r)
        if name != "large":   # the gathered sum: the same bits on every rank
            assert all(torch.equal(results[r][name], results[0][name]) for r in range(world)), name
    for r in range(world):   # the ranks' parts side by side in the last dim, in rank order
        assert torch.equal(results[r]["gather"], torch.tensor([[0.0] * 3 + [1.0] * 3 + [2.0] * 3] * 2))
