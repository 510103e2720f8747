"""Issue 25: block-scaled FP8 (128 x 128 blocks, Qwen3-*-FP8's format) on Llama-3-8B's linear shapes,
one GPU, against the per-channel FP8 kernels and bf16 in the same run.

Each figure is one matmul inside a CUDA graph of back-to-back calls rotating over enough weight
copies to miss the L2 cache (benchmarks/quant_gemv.py's timing). Decode rows: the block kernels'
"runs" GEMV and "dot" tiles (`--sweep`: several settings each, the fastest reported), the
per-channel FP8 GEMV with its tuned tiles, the bf16 Triton GEMV. Prefill rows: the block "dot"
tiles, cuBLAS's block-scaled `_scaled_mm` (with the per-group activation quantization),
dequantize-then-cuBLAS, per-channel FP8 (`_scaled_mm` after its activation quantization) and bf16
cuBLAS.

    python3 benchmarks/fp8_block.py [--sweep] [--json out.json] [--rows 1,4,16] [--prefill-rows 128,512,2048]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant_gemv import SHAPES, copies, graph_time  # noqa: E402

from shardserve.kernels.gemv import triton_gemv  # noqa: E402
from shardserve.kernels.quant import triton_fp8_block, triton_fp8_gemv, triton_fp8_quant  # noqa: E402
from shardserve.quantization.fp8 import quantize_rows  # noqa: E402
from shardserve.quantization.fp8_block import compact_scale_rows  # noqa: E402

BLOCK = 128


def block_weight(total: int, k: int) -> tuple:
    w = (torch.randn(total, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = torch.rand(-(-total // BLOCK), -(-k // BLOCK), device="cuda") * 1e-4
    return (w, *compact_scale_rows(grid.repeat_interleave(BLOCK, 0)[:total]), grid)


def tile_choices(rows: int, gated: bool, sweep: bool) -> list:
    default = triton_fp8_block.default_tiles(rows, gated, BLOCK)
    if not sweep:
        return [default]
    if rows <= triton_fp8_block.RUNS_ROWS:
        runs = [("runs", bn, c, w, s, sp) for bn, c, w, s, sp in
                [(16, 128, 1, 3, 1), (16, 128, 1, 4, 2), (32, 128, 2, 3, 1), (32, 128, 2, 3, 2), (32, 64, 2, 3, 1),
                 (64, 128, 4, 3, 1), (16, 64, 1, 4, 1), (32, 128, 2, 4, 4)]]
        return [default] + runs + [("dot", 16, 32, 128, 4, 4), ("dot", 16, 64, 128, 4, 3)]
    if rows <= triton_fp8_block.MAX_ROWS:
        return [default] + [("dot", 16, bn, bk, w, s) for bn, bk, w, s in
                            [(16, 128, 2, 4), (32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3)]]
    return [default] + [("dot", bm, bn, bk, w, s) for bm, bn, bk, w, s in
                        [(64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 64, 128, 4, 4),
                         (128, 256, 64, 8, 3), (32, 128, 128, 4, 4)]]


def run(rows_list: list[int], prefill_rows: list[int], sweep: bool) -> list[dict]:
    results = []
    for name, (n, k, gated) in SHAPES.items():
        total = 2 * n if gated else n
        c = copies(total * k)
        blocks = [block_weight(total, k) for _ in range(c)]
        channel = [quantize_rows(torch.randn(total, k, device="cuda") * 0.05) for _ in range(c)]
        dense = [torch.randn(total, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(max(2, c // 2))]
        for rows in rows_list + prefill_rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "gated": gated, "rows": rows}
            best = None
            for tiles in tile_choices(rows, gated, sweep):
                try:
                    t = graph_time(lambda b: triton_fp8_block.matmul(x, *b[:3], BLOCK, gated=gated, tiles=tiles),
                                   blocks)
                except Exception as e:   # a setting that does not compile or fit: skipped
                    print(f"  {name} {rows} {tiles}: {type(e).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, tiles)
            row["block_us"], row["block_tiles"] = best[0] * 1e6, list(best[1])
            if rows > triton_fp8_block.MAX_ROWS:
                out_n = n if gated else total

                def dequantized(b):
                    y = F.linear(x, triton_fp8_block.dequantize(*b[:3], BLOCK, torch.bfloat16))
                    return y[:, :out_n] * y[:, out_n:] if gated else y
                row["block_dequantize_us"] = graph_time(dequantized, blocks) * 1e6
                block_mm = graph_time(lambda b: triton_fp8_block.scaled_mm(x, b[0], b[3]), blocks)
                row["block_scaled_mm_us"] = block_mm * 1e6

                def scaled_mm(w):
                    xq, xs = triton_fp8_quant.quantize_tokens(x)
                    return torch._scaled_mm(xq, w[0].t(), scale_a=xs, scale_b=w[1].view(1, -1), out_dtype=x.dtype)
                row["channel_fp8_us"] = graph_time(scaled_mm, channel) * 1e6
                row["bf16_us"] = graph_time(lambda w: F.linear(x, w), dense) * 1e6
            else:
                row["channel_fp8_us"] = graph_time(lambda w: triton_fp8_gemv.gemv(x, *w, gated=gated), channel) * 1e6
                row["bf16_us"] = graph_time(lambda w: triton_gemv.gemv(x, w, gated=gated), dense) * 1e6
                row["block_gb_s"] = total * k / best[0] / 1e9
            results.append(row)
            print(json.dumps(row), flush=True)
        del blocks, channel, dense
        torch.cuda.empty_cache()
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--prefill-rows", default="128,512,2048")
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    rows = [int(r) for r in ns.rows.split(",") if r]
    prefill = [int(r) for r in ns.prefill_rows.split(",") if r]
    results = run(rows, prefill, ns.sweep)
    print(f"\n{torch.cuda.get_device_name()}")
    print(f"{'shape':8} {'rows':>5} {'block':>9} {'scaled_mm':>10} {'dequant+cuBLAS':>15} {'fp8/channel':>12} "
          f"{'bf16':>9}  block tiles")
    for r in results:
        deq = f"{r['block_dequantize_us']:.1f}" if "block_dequantize_us" in r else "-"
        smm = f"{r['block_scaled_mm_us']:.1f}" if "block_scaled_mm_us" in r else "-"
        print(f"{r['shape']:8} {r['rows']:5d} {r['block_us']:9.1f} {smm:>10} {deq:>15} {r['channel_fp8_us']:12.1f} "
              f"{r['bf16_us']:9.1f}  {r['block_tiles']}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
