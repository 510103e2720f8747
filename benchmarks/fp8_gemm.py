"""Issue 25: FP8 W8A8 matmuls past the GEMV's 16 rows (batched decode, prefill), Llama-3-8B's linear
shapes, one GPU. Per shape and row count, the time of one call inside a CUDA graph of back-to-back
calls over two weight copies: bf16 cuBLAS (`F.linear`); `_scaled_mm` alone; the per-token
activation quantization in torch (six kernels) and in one Triton pass; and the whole FP8 linear
with each. Also checks the Triton quantization against the torch one (bit for bit).

    python3 benchmarks/fp8_gemm.py [--rows 32,256,2048] [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from shardserve.kernels.quant import triton_fp8_quant
from shardserve.quantization.fp8 import quantize_rows, quantize_tokens

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def graph_time(fn, reps: int = 20) -> float:
    """Seconds per call of `fn` replayed from a CUDA graph of `reps` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / 5 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32,64,128,256,512,2048,8192")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_rows(w)
        wt, ws_row = wq.t(), ws.view(1, -1)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q_ref, s_ref = quantize_tokens(x)
            q_tri, s_tri = triton_fp8_quant.quantize_tokens(x)
            exact = torch.equal(q_ref.view(torch.uint8), q_tri.view(torch.uint8)) and torch.equal(s_ref, s_tri)

            def fp8(quant):
                q, s = quant(x)
                return torch._scaled_mm(q, wt, scale_a=s, scale_b=ws_row, out_dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "rows": m, "triton_quant_exact": exact,
                   "bf16_us": 1e6 * graph_time(lambda: F.linear(x, w)),
                   "scaled_mm_us": 1e6 * graph_time(lambda: torch._scaled_mm(q_ref, wt, scale_a=s_ref, scale_b=ws_row,
                                                                          out_dtype=torch.bfloat16)),
                   "quant_torch_us": 1e6 * graph_time(lambda: quantize_tokens(x)),
                   "quant_triton_us": 1e6 * graph_time(lambda: triton_fp8_quant.quantize_tokens(x)),
                   "fp8_torch_quant_us": 1e6 * graph_time(lambda: fp8(quantize_tokens)),
                   "fp8_triton_quant_us": 1e6 * graph_time(lambda: fp8(triton_fp8_quant.quantize_tokens))}
            row["speedup_vs_bf16"] = row["bf16_us"] / row["fp8_triton_quant_us"]
            results.append(row)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
