"""All-reduce microbenchmark: latency and bus bandwidth by message size, NCCL over local GPUs or
gloo over CPU processes, and across nodes with `--peers`.

Every rank is its own process (`python -m shardserve.doctor.allreduce`), joins through
torch.distributed's TCP store with the engine's own `init_distributed`, and all-reduces through
`distributed/comm.py` like a tensor-parallel layer does. Running ranks as subprocesses also lets
the doctor capture NCCL_DEBUG=INFO output, which tells which transport NCCL picked."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

RESULT_TAG = "SHARDSERVE_DOCTOR_RESULT "
CPU_SIZES = [8 << 10, 64 << 10, 1 << 20, 8 << 20]
GPU_SIZES = [8 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]   # the sizes of the 2x H200 capture


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' busbw: algorithm bandwidth x 2(n-1)/n, comparable with a link's speed."""
    return nbytes / seconds * 2 * (world - 1) / world


def _worker(rank: int, world: int, init: str, device_type: str, sizes: list[int], budget_s: float) -> dict:
    import torch

    from shardserve.distributed import comm
    from shardserve.distributed.setup import destroy_distributed, init_distributed
    device = torch.device("cuda", rank % torch.cuda.device_count()) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    init_distributed(rank, world, 1, init, device, timeout_s=60.0, fast_all_reduce=False)   # NCCL itself
    points = []
    try:
        for nbytes in sizes:
            x = torch.ones(max(nbytes // dtype.itemsize, 1), dtype=dtype, device=device)
            for _ in range(3):                                   # warm-up (first calls set up channels)
                comm.tensor_model_parallel_all_reduce(x)
            sync()
            t = time.perf_counter()
            comm.tensor_model_parallel_all_reduce(x)
            sync()
            # Every rank must run the same number of iterations: agree on the slowest first guess.
            probe = torch.tensor([time.perf_counter() - t], dtype=torch.float32, device=device)
            comm.tensor_model_parallel_all_reduce(probe)
            iters = int(min(max(budget_s / max(float(probe.item()), 1e-7), 5), 200))
            sync()
            t = time.perf_counter()
            for _ in range(iters):
                comm.tensor_model_parallel_all_reduce(x)
            sync()
            seconds = (time.perf_counter() - t) / iters
            points.append({"bytes": nbytes, "seconds": seconds, "iters": iters,
                           "busbw": bus_bandwidth(nbytes, seconds, world)})
    finally:
        destroy_distributed()
    return {"world": world, "backend": "nccl" if device.type == "cuda" else "gloo", "device": device.type,
            "dtype": str(dtype).replace("torch.", ""), "points": points}


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ, **(extra or {}))
    if env.get("NCCL_DEBUG") == "INFO" and extra and "NCCL_DEBUG" in extra:
        env.pop("NCCL_DEBUG_FILE", None)       # the doctor reads NCCL's lines from the ranks' output
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_ranks(ranks: list[int], world: int, init: str, device_type: str, sizes: list[int], timeout: float,
              env: dict[str, str] | None = None, budget_s: float = 0.15) -> dict[str, Any]:
    """Start `ranks` as subprocesses and wait for them. Returns {"result": rank 0's (or the lowest
    rank's) measurements or None, "log": everything they printed, "error": why not, or None}."""
    procs, outs = [], []
    for rank in ranks:
        out = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, "-m", "shardserve.doctor.allreduce", "--rank", str(rank), "--world", str(world),
               "--init", init, "--device", device_type, "--sizes", ",".join(map(str, sizes)),
               "--budget", str(budget_s)]
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_child_env(env)))
        outs.append(out)
    deadline = time.monotonic() + timeout
    error = None
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
            break
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    log = ""
    for out in outs:
        out.seek(0)
        log += out.read()
        out.close()
    found = [json.loads(line[len(RESULT_TAG):]) for line in log.splitlines() if line.startswith(RESULT_TAG)]
    result = min(found, key=lambda r: r["rank"]) if found else None
    if error is None and (result is None or any(p.returncode for p in procs)):
        tail = [l for l in log.splitlines() if l.strip() and not l.startswith(RESULT_TAG)][-3:]
        error = f"exit codes {[p.returncode for p in procs]}: " + " | ".join(tail)
    return {"result": result, "log": log, "error": error}


def run_local(device_type: str, world: int, timeout: float, nccl_debug: bool = False) -> dict[str, Any]:
    """All ranks on this machine over loopback: gloo with 2 CPU processes, or NCCL over local GPUs."""
    # INIT carries the "Channel .. via .." lines, NET the network NCCL picked; a user's narrower
    # NCCL_DEBUG_SUBSYS would hide them.
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV"} if nccl_debug else {}
    sizes = GPU_SIZES if device_type == "cuda" else CPU_SIZES
    from shardserve.distributed.parallel_state import host_store
    store, init = host_store(world, timeout)   # referenced here until the ranks are done
    return run_ranks(list(range(world)), world, init, device_type, sizes, timeout, env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of the doctor's all-reduce benchmark")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True,
                   help="tcp://host:port of the rendezvous (rank 0 hosts it), or store://host:port (already hosted)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--sizes", default=",".join(map(str, CPU_SIZES)))
    p.add_argument("--budget", type=float, default=0.15, help="seconds of timed iterations per size")
    a = p.parse_args(argv)
    result = _worker(a.rank, a.world, a.init, a.device, [int(s) for s in a.sizes.split(",")], a.budget)
    print(RESULT_TAG + json.dumps(dict(result, rank=a.rank)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
