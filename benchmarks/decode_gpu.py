"""Single-stream decode ms/token on GPUs beside the roofline (weight bytes per GPU / HBM bandwidth
measured in the same run), for random-weight models with real shapes.

    python3 benchmarks/decode_gpu.py --shape llama-3-8b --tp 1 2 --shape2 llama-3-70b:2 --json out.json

Also measures the NCCL all-reduce latency of a decode-sized message between the GPUs, and what
the per-token all-reduces (2 per layer) cost at that latency.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from shardserve.bench.report import report
from shardserve.bench.shapes import param_counts, shape_config, write_shape_dir


def config_dir(shape: str) -> str:
    return write_shape_dir(shape_config(shape), shape)


def weight_bytes(shape: str) -> int:
    return 2 * param_counts(shape_config(shape))["total"]   # bf16


def cuda_seconds_per_call(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def hbm_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / cuda_seconds_per_call(lambda: y.copy_(x), 3, 10)   # bytes read + written per s


def decode_ms_per_token(shape: str, tp: int, tokens: int = 64) -> float:
    """Run in a fresh process so that no earlier engine's memory is still held on the GPUs."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_decode_ms_per_token, (shape, tp, tokens))


def _decode_ms_per_token(shape: str, tp: int, tokens: int) -> float:
    from shardserve import LLM, SamplingParams
    llm = LLM(config_dir(shape), load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
              max_model_len=2048, tensor_parallel_size=tp, gpu_memory_utilization=0.9, show_progress=False)
    prompt = list(range(1000, 1128))
    timings = {}
    for n in (1, tokens + 1):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        timings[n] = time.perf_counter() - t
    llm.engine.shutdown()
    return 1000 * (timings[tokens + 1] - timings[1]) / tokens


def _allreduce_worker(rank: int, world: int, port: int, q) -> None:
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(4096, dtype=torch.bfloat16, device="cuda")   # 8 KiB: one token's hidden state (4096 x bf16)
    seconds = cuda_seconds_per_call(lambda: dist.all_reduce(x), 20, 200)
    if rank == 0:
        q.put(seconds * 1e6)
    dist.destroy_process_group()


def allreduce_latency_us(world: int) -> float:
    import multiprocessing as mp

    from shardserve.executor.multiproc import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    value = q.get(timeout=120)
    for p in procs:
        p.join()
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=["llama-3-8b:1", "llama-3-8b:2", "llama-3-70b:2"],
                   help="shape:tp pairs")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    bw = hbm_bandwidth()
    result = {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
              "hbm_copy_TBps": bw / 1e12, "runs": []}
    if torch.cuda.device_count() >= 2:
        result["allreduce_8KiB_us"] = allreduce_latency_us(2)
    for run in args.runs:
        shape, tp = run.split(":")[0], int(run.split(":")[1])
        if tp > torch.cuda.device_count():
            continue
        ms = decode_ms_per_token(shape, tp)
        roofline = weight_bytes(shape) / tp / bw * 1000
        entry = {"shape": shape, "tp": tp, "decode_ms_per_token": ms, "roofline_ms": roofline,
                 "ratio_to_roofline": ms / roofline}
        if tp > 1 and "allreduce_8KiB_us" in result:
            n = 2 * shape_config(shape)["num_hidden_layers"]
            entry["allreduce_ms_per_token"] = n * result["allreduce_8KiB_us"] / 1000
        result["runs"].append(entry)
        print(json.dumps(entry), flush=True)
    report(result, args.json)


if __name__ == "__main__":
    main()
