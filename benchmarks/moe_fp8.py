"""Issue 25: FP8 MoE experts in the fused Triton kernel against bf16 experts, one GPU.

One fused-MoE layer of Qwen3-30B-A3B's expert shapes (128 experts, hidden 2048, intermediate 768,
top-8), random experts and routings, bf16 activations; each figure is one call inside a CUDA graph
of calls over 8 routings (so a call reads other experts than the last), per token count. Formats:
bf16 experts, FP8 with a scale per output row (`-q fp8`, FP8 checkpoints) and FP8 with 128 x 128
block scales (Qwen3-30B-A3B-FP8). Kernel choices compared in the same run: bf16 activations (W8A16)
with the dot in fp16 or bf16 (`FP16_DOT`), FP8 activations with FP8 dots (`W8A8`), steps of 64 or
128 inputs; and what `fused_moe` picks by itself (W8A16 in fp16 up to triton_moe.W8A16_PICKS_PER_EXPERT
picks per expert, W8A8 past that, steps of 128).

    python3 benchmarks/moe_fp8.py [--json out.json] [--tokens 1,8,64,512,2048]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from shardserve.kernels.moe import reference, triton_moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant_gemv import graph_time  # noqa: E402

E, H, I, TOP_K = 128, 2048, 768, 8


def experts(block: bool) -> tuple:
    """(w13, s13, w2, s2): E4M3 experts with row scales or 128 x 128 block scales."""
    out = []
    for rows, cols in ((2 * I, H), (H, I)):
        q = (torch.randn(E, rows, cols, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        if block:
            scales = torch.rand(E, rows // 128, cols // 128, device="cuda") * 1e-4 + 1e-5
            scale_row = (torch.arange(rows, device="cuda") // 128).to(torch.int32)
            out += [q, reference.BlockScales(scales, scale_row, 128, uniform_rows=128)]
        else:
            out += [q, torch.rand(E, rows, device="cuda") * 1e-4 + 1e-5]
    return tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--tokens", default="1,2,4,8,16,64,256,512,2048")
    args = parser.parse_args()
    rows13, rs13, rows2, rs2 = experts(False)
    blk13, bs13, blk2, bs2 = experts(True)
    b13 = reference.dequantize_experts(blk13, bs13).bfloat16()
    b2 = reference.dequantize_experts(blk2, bs2).bfloat16()
    out = {"device": torch.cuda.get_device_name(), "shape": dict(E=E, H=H, I=I, top_k=TOP_K), "rows": []}
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, H, device="cuda").to(torch.bfloat16)
        routings = [reference.route_topk(torch.randn(tokens, E, device="cuda"), TOP_K, True) for _ in range(8)]
        cfg = triton_moe.get_config(E, I, H, tokens, top_k=TOP_K)

        def t(w13, w2, s13=None, s2=None, **extra) -> float | None:
            try:
                return 1e6 * graph_time(lambda r: triton_moe.fused_moe(x, w13, w2, *r, config={**cfg, **extra},
                                                                       w13_scale=s13, w2_scale=s2), routings)
            except Exception as e:   # a tile past the shared memory (steps of 128 on large tiles)
                print(f"{tokens} tokens {extra}: {type(e).__name__}", flush=True)
                return None
        row = {"tokens": tokens, "bf16_us": t(b13, b2), "rows_default_us": t(rows13, rows2, rs13, rs2),
               "block_default_us": t(blk13, blk2, bs13, bs2),   # what fused_moe picks by itself
               "block_scale_per_column_us": t(blk13, blk2, bs13, bs2, TILE_SCALE=False)}
        for fp16 in (False, True):   # FP8 experts against bf16 activations (W8A16), the dot in fp16 or bf16
            row[f"rows_w8a16_fp16={int(fp16)}_us"] = t(rows13, rows2, rs13, rs2, FP16_DOT=fp16, W8A8=False)
            for step in (64, 128):
                row[f"block_w8a16_fp16={int(fp16)}_k{step}_us"] = t(
                    blk13, blk2, bs13, bs2, FP16_DOT=fp16, BLOCK_SIZE_K_BLOCKS=step, W8A8=False)
        for step in (64, 128):   # FP8 activations and FP8 dots
            row[f"rows_w8a8_k{step}_us"] = t(rows13, rows2, rs13, rs2, W8A8=True, BLOCK_SIZE_K_BLOCKS=step)
            row[f"block_w8a8_k{step}_us"] = t(blk13, blk2, bs13, bs2, W8A8=True, BLOCK_SIZE_K_BLOCKS=step)
        out["rows"].append({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
        print(json.dumps(out["rows"][-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
