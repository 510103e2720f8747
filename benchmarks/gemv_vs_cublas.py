"""Skinny linear layers (decode batches of 1..16 rows) on one GPU: the Triton weight-streaming kernel
(kernels/gemv/triton_gemv.py) against cuBLAS (F.linear), on the weight shapes of Llama-3-8B (TP 1 and 2)
and Llama-3-70B (TP 2), issue 6.

    python3 benchmarks/gemv_vs_cublas.py [--sweep] [--json out.json]

Each shape gets enough distinct weight copies to be 4x the L2, so every call reads its weight from
HBM as in a decode step; a CUDA graph runs one call per copy and is replayed. Reported: us per call
and the weight bytes read per second, beside the device-to-device copy bandwidth measured in the
same run. The gated form (gate_up with SiLU-and-mul fused) is compared with cuBLAS gate_up plus the
Triton SiLU-and-mul kernel it replaces. --sweep also tries other tile and pipeline settings.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve.bench.report import save  # noqa: E402
from shardserve.worker.graph_profile import graph_call_ms  # noqa: E402

# name: (N, K, gated) — N is the output features (per gate/up half when gated)
SHAPES = {
    "8b.qkv": (6144, 4096, False), "8b.o": (4096, 4096, False), "8b.gate_up": (14336, 4096, True),
    "8b.down": (4096, 14336, False), "8b.lm_head": (128256, 4096, False),
    "8b-tp2.qkv": (3072, 4096, False), "8b-tp2.o": (4096, 2048, False), "8b-tp2.gate_up": (7168, 4096, True),
    "8b-tp2.down": (4096, 7168, False),
    "70b-tp2.qkv": (5120, 8192, False), "70b-tp2.o": (8192, 4096, False), "70b-tp2.gate_up": (14336, 8192, True),
    "70b-tp2.down": (8192, 14336, False),
}


def time_graph(fn, copies: int) -> float:
    """Seconds per call: one graph makes `copies` calls (each on its own weight)."""
    return graph_call_ms(fn, copies) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json")
    args = ap.parse_args()
    from shardserve.bench.offline import measure_bandwidth
    from shardserve.kernels import triton_ops
    from shardserve.kernels.gemv import triton_gemv
    dev = torch.device("cuda")
    copy_bw = measure_bandwidth(dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    print(f"{torch.cuda.get_device_name(dev)}: copy bandwidth {copy_bw / 1e12:.2f} TB/s, L2 {l2 >> 20} MiB", flush=True)
    results = {"device": torch.cuda.get_device_name(dev), "copy_bandwidth": copy_bw, "shapes": {}}
    configs = [dict()]   # the defaults the engine uses
    if args.sweep:
        configs = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
                   for bn, bk, w, st in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (2, 3, 4))]
    top = {}   # per shape, the best configs at one row, tried again with more rows
    for name in args.shapes.split(","):
        n, k, gated = SHAPES[name]
        rows_n = 2 * n if gated else n
        nbytes = rows_n * k * 2
        copies = max(2, -(-4 * l2 // nbytes))
        weights = [torch.randn(rows_n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            if gated:
                ref = triton_ops.silu_and_mul(F.linear(x, weights[0]))
                cublas = time_graph(lambda i: triton_ops.silu_and_mul(F.linear(x, weights[i])), copies)
            else:
                ref = F.linear(x, weights[0])
                cublas = time_graph(lambda i: F.linear(x, weights[i]), copies)
            timed = []
            for cfg in configs if rows == 1 else top[name]:
                try:
                    got = triton_gemv.gemv(x, weights[0], gated=gated, **cfg)
                except Exception as e:   # a tile too large for shared memory, say
                    print(f"  skipped {cfg}: {type(e).__name__}", flush=True)
                    continue
                err = (got.float() - ref.float()).abs().max().item()
                t = time_graph(lambda i: triton_gemv.gemv(x, weights[i], gated=gated, **cfg), copies)
                timed.append((t, cfg, err))
            timed.sort(key=lambda r: r[0])
            if rows == 1:
                top[name] = [c for _, c, _ in timed[:5]]
            t, cfg, err = timed[0]
            row = {"cublas_us": cublas * 1e6, "triton_us": t * 1e6, "config": cfg, "max_abs_err": err,
                   "cublas_tbps": nbytes / cublas / 1e12, "triton_tbps": nbytes / t / 1e12}
            results["shapes"][f"{name}.rows{rows}"] = row
            print(f"{name:16s} rows {rows:2d}: cuBLAS {cublas * 1e6:7.1f} us ({row['cublas_tbps']:.2f} TB/s)  "
                  f"Triton {t * 1e6:7.1f} us ({row['triton_tbps']:.2f} TB/s)  ratio {cublas / t:.2f}x  "
                  f"max err {err:.2e} {cfg}", flush=True)
        weights = None
        torch.cuda.empty_cache()
    save(results, args.json)


if __name__ == "__main__":
    main()
