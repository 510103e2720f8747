"""Decode-sized matmuls (17-256 rows) on one GPU: kernels/matmul/triton_skinny.py's tiles against
cuBLAS (F.linear for bf16, torch._scaled_mm with row-wise scales for FP8), Llama-3-8B's shapes (qkv,
o, gate_up, down at TP=1), with each shape's bounds: its FLOPs at the measured matmul peak and its
weight bytes at the measured copy bandwidth.

    python3 benchmarks/skinny_matmul.py [--dtype bf16|fp8] [--rows 32,64,128,256] [--json out.json]
        [--write-configs]

Each case runs 8 calls (over 4 weight copies, so the weights come from HBM) in a CUDA graph.
--write-configs (fp8): the table the FP8 layers read (kernels/quant/tuned.py), per shape and row
count the fastest tiles where they beat `torch._scaled_mm` by 3% or more, else "scaled_mm".
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve.bench.report import save  # noqa: E402
from shardserve.worker.graph_profile import graph_call_ms  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 4


def _tiles(dtype: str, rows: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) to try."""
    ms = (32, 64) if rows <= 32 else (64, 128)
    ks = (128, 256) if dtype == "fp8" else (64, 128)
    return [t for t in itertools.product(ms, (64, 128), ks, (4, 8), (3, 4))
            if t[0] * t[1] * t[2] <= 64 * 128 * 256]   # larger ones run out of shared memory


def _peak_and_bandwidth(dtype: str) -> tuple[float, float]:
    """(TFLOP/s of a large matmul in this dtype, GB/s of a large copy), measured here."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    if dtype == "fp8":
        a8, one = a.to(torch.float8_e4m3fn), torch.ones(1, device="cuda")
        ms = graph_call_ms(lambda i: torch._scaled_mm(a8, a8.t(), scale_a=one, scale_b=one,
                                                      out_dtype=torch.bfloat16), 4)
    else:
        ms = graph_call_ms(lambda i: a @ a, 4)
    tflops = 2 * 8192 ** 3 / ms / 1e9
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    gbs = 2 * src.numel() / graph_call_ms(lambda i: dst.copy_(src), 4) / 1e6
    return tflops, gbs


def main() -> None:
    from shardserve.kernels.matmul import triton_skinny
    from shardserve.kernels.quant import tuned
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--rows", default="32,64,96,128,160,192,224,256")
    ap.add_argument("--json")
    ap.add_argument("--write-configs", action="store_true")
    args = ap.parse_args()
    fp8 = args.dtype == "fp8"
    tflops, gbs = _peak_and_bandwidth(args.dtype)
    print(f"{torch.cuda.get_device_name()}: {args.dtype} matmul peak {tflops:.0f} TFLOP/s, copy {gbs:.0f} GB/s")
    results = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        w_scale = torch.rand(n, device="cuda") + 0.5
        if fp8:
            ws = [w.to(torch.float8_e4m3fn) for w in ws]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            x_scale = torch.rand(rows, 1, device="cuda") + 0.5
            if fp8:
                x = x.to(torch.float8_e4m3fn)
                ref = lambda i: torch._scaled_mm(x, ws[i % COPIES].t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                                                 out_dtype=torch.bfloat16)
            else:
                ref = lambda i: torch.nn.functional.linear(x, ws[i % COPIES])
            want = ref(0).float()
            cublas = graph_call_ms(ref, 2 * COPIES) * 1e3
            bound = max(2 * rows * n * k / tflops / 1e6, n * k * ws[0].element_size() / gbs / 1e3)
            best = None
            for tiles in _tiles(args.dtype, rows):
                scales = (x_scale, w_scale) if fp8 else (None, None)

                def call(i, tiles=tiles, scales=scales):
                    return triton_skinny.matmul(x, ws[i % COPIES], None, *scales, out_dtype=torch.bfloat16,
                                                tiles=tiles)
                try:
                    err = ((call(0).float() - want).norm() / want.norm()).item()
                    us = graph_call_ms(call, 2 * COPIES) * 1e3
                except Exception as e:   # out of shared memory or registers
                    print(f"  {name} {rows} {tiles}: {type(e).__name__}", flush=True)
                    continue
                assert err < 1e-2, (name, rows, tiles, err)
                if best is None or us < best[0]:
                    best = (us, tiles)
            row = {"shape": name, "n": n, "k": k, "rows": rows, "cublas_us": cublas, "triton_us": best[0],
                   "tiles": best[1], "bound_us": bound}
            results.append(row)
            print(f"{name:8s} rows {rows:3d}: cuBLAS {cublas:7.1f} us ({bound / cublas:4.0%} of bound), Triton "
                  f"{best[0]:7.1f} us ({bound / best[0]:4.0%}) {best[1]}, {cublas / best[0]:.2f}x", flush=True)
        ws = None
        torch.cuda.empty_cache()
    save({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "peak_tflops": tflops, "copy_gb_s": gbs,
          "results": results}, args.json)
    if args.write_configs and fp8:
        table = {tuned.key("mm_fp8", r["n"], r["k"], False, r["rows"]):
                 list(r["tiles"]) if r["triton_us"] * 1.03 <= r["cublas_us"] else ["scaled_mm"] for r in results}
        print("wrote", tuned.write(table, torch.cuda.get_device_name()))


if __name__ == "__main__":
    main()
