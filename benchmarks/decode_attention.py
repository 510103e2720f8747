"""Paged decode attention on one GPU (issue 6): the Triton kernel with each request's keys split
over several programs (flash-decoding, the default for small batches) against one program per
(request, KV head), across batch sizes and context lengths, Llama-3-8B's attention shape (32 query
heads, 8 KV heads, head_dim 128, bf16, 16-token blocks; `--kv-cache-dtype fp8`: an E4M3 pool).

    python3 benchmarks/decode_attention.py [--sweep] [--kv-cache-dtype fp8] [--json out.json]

Each case runs 32 calls (one per layer, over 4 separate pools so the reads come from HBM) in a
CUDA graph; reported: us per call and the K/V bytes read per second.
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve.bench.report import save  # noqa: E402
from shardserve.worker.graph_profile import graph_call_ms  # noqa: E402

HQ, HK, DIM, BLOCK = 32, 8, 128, 16   # Llama-3-8B's attention, 16-token blocks


def _case(batch: int, ctx: int, copies: int, kv_dtype: torch.dtype = torch.bfloat16, lens: list[int] | None = None):
    """`copies` separate pools of kv_dtype (so calls read HBM, not L2), a block table scattering
    each request's blocks over the pool, lengths (`ctx` each, or `lens`), q and out."""
    dev = torch.device("cuda")
    blocks_per_seq = -(-(max(lens) if lens else ctx) // BLOCK)
    pool_blocks = batch * blocks_per_seq + 1
    pools = [torch.randn(2, HK, pool_blocks, BLOCK, DIM, device=dev, dtype=torch.bfloat16).to(kv_dtype)
             for _ in range(copies)]
    tables = (torch.randperm(pool_blocks - 1, device=dev)[:batch * blocks_per_seq] + 1).int().view(batch, -1)
    lens = torch.tensor(lens, dtype=torch.int32, device=dev) if lens else torch.full((batch,), ctx, dtype=torch.int32,
                                                                                       device=dev)
    q = torch.randn(batch, HQ, DIM, device=dev, dtype=torch.bfloat16)
    return pools, tables, lens, q, torch.empty_like(q)


def _widenings(kv_dtype: torch.dtype) -> tuple[bool, ...]:
    """The `f16_kv` settings to try: an fp8 pool widened to bf16 (the default) or to fp16."""
    return (False, True) if kv_dtype == torch.float8_e4m3fn else (False,)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument("--ragged", action="store_true",
                    help="large batches of mixed lengths (offline throughput's decode steps): the requests in "
                         "random order against longest first, a few tile sizes")
    ap.add_argument("--sweep", action="store_true",
                    help="large batches only (the offline-throughput regime, one program per (request, KV head)): "
                         "tokens per iteration, warps and pipeline stages")
    args = ap.parse_args()
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    if args.sweep:
        return sweep(args.json, kv_dtype)
    if args.ragged:
        return ragged(args.json, kv_dtype)
    from shardserve.kernels.attention.triton_decode import num_splits, paged_decode_attention
    dev = torch.device("cuda")
    results = []
    for batch, ctx in [(1, 256), (1, 2048), (1, 8192), (1, 32768), (8, 2048), (8, 8192), (32, 1024), (32, 4096)]:
        pools, tables, lens, q, out = _case(batch, ctx, 4, kv_dtype)
        kv_bytes = 2 * batch * ctx * HK * DIM * kv_dtype.itemsize
        row = {"batch": batch, "context": ctx}
        for name, splits in (("one_program", 1), ("split", num_splits(batch, HK, dev))):
            def call(i, splits=splits):
                p = pools[i % 4]
                paged_decode_attention(q, p[0], p[1], tables, lens, out, DIM ** -0.5, None, splits=splits)
            row[name + "_us"], row[name + "_splits"] = graph_call_ms(call, 32) * 1e3, splits
        row["speedup"] = row["one_program_us"] / row["split_us"]
        results.append(row)
        print(f"batch {batch:3d} context {ctx:6d}: one program per head {row['one_program_us']:8.1f} us, "
              f"{row['split_splits']:2d} splits {row['split_us']:8.1f} us "
              f"({kv_bytes / row['split_us'] / 1e6:.2f} TB/s), "
              f"{row['speedup']:.2f}x", flush=True)
        pools = None
        torch.cuda.empty_cache()
    save({"device": torch.cuda.get_device_name(dev), "kv_dtype": str(kv_dtype), "results": results}, args.json)


def sweep(json_path: str | None, kv_dtype: torch.dtype) -> None:
    from shardserve.kernels.attention.triton_decode import paged_decode_attention
    dev, scale = torch.device("cuda"), DIM ** -0.5
    results = []
    for batch, ctx in [(64, 1024), (256, 512), (256, 1024), (256, 2048)]:
        pools, tables, lens, q, out = _case(batch, ctx, 2, kv_dtype)
        ref = torch.empty_like(q)
        paged_decode_attention(q, pools[0][0], pools[0][1], tables, lens, ref, scale, None, splits=1)
        kv_bytes = 2 * batch * ctx * HK * DIM * kv_dtype.itemsize
        for tokens, warps, stages, f16_kv in itertools.product((32, 64, 128, 256), (4, 8), (2, 3, 4),
                                                              _widenings(kv_dtype)):
            tune = {"tokens": tokens, "num_warps": warps, "num_stages": stages, "f16_kv": f16_kv}
            try:
                paged_decode_attention(q, pools[0][0], pools[0][1], tables, lens, out, scale, None, splits=1, tune=tune)
                err = (out.float() - ref.float()).abs().max().item()

                def call(i, tune=tune):
                    p = pools[i % 2]
                    paged_decode_attention(q, p[0], p[1], tables, lens, out, scale, None, splits=1, tune=tune)
                us = graph_call_ms(call, 8) * 1e3
            except Exception as e:   # out of shared memory or registers
                print(f"batch {batch} context {ctx} {tune}: {type(e).__name__}", flush=True)
                continue
            results.append({"batch": batch, "context": ctx, **tune, "us": us, "max_err": err,
                            "tb_s": kv_bytes / us / 1e6})
            print(f"batch {batch:3d} context {ctx:5d} tokens {tokens:3d} warps {warps} stages {stages} f16 {f16_kv:d}: "
                  f"{us:8.1f} us ({kv_bytes / us / 1e6:.2f} TB/s), max diff {err:.1e}", flush=True)
        pools = None
        torch.cuda.empty_cache()
    save({"device": torch.cuda.get_device_name(dev), "kv_dtype": str(kv_dtype), "sweep": results}, json_path)


def ragged(json_path: str | None, kv_dtype: torch.dtype) -> None:
    """One program per (request, KV head) over lengths drawn uniformly: the order the requests come
    in decides which programs start last, and so how long the last multiprocessors run alone."""
    from shardserve.kernels.attention.triton_decode import paged_decode_attention
    dev, scale, rng = torch.device("cuda"), DIM ** -0.5, random.Random(0)
    results = []
    for batch, lo, hi in [(256, 230, 1150), (256, 100, 2047), (128, 500, 2000), (64, 100, 1100)]:
        drawn = [rng.randint(lo, hi) for _ in range(batch)]
        for order in ("random", "longest first"):
            lens = sorted(drawn, reverse=True) if order == "longest first" else drawn
            pools, tables, lens_t, q, out = _case(batch, 0, 2, kv_dtype, lens)
            kv_bytes = 2 * sum(lens) * HK * DIM * kv_dtype.itemsize
            for tokens, f16_kv in itertools.product((32, 64, 128), _widenings(kv_dtype)):
                def call(i, tune={"tokens": tokens, "f16_kv": f16_kv}):
                    p = pools[i % 2]
                    paged_decode_attention(q, p[0], p[1], tables, lens_t, out, scale, None, tune=tune)
                us = graph_call_ms(call, 8) * 1e3
                results.append({"batch": batch, "lengths": [lo, hi], "order": order, "tokens": tokens,
                                "f16_kv": f16_kv, "us": us, "tb_s": kv_bytes / us / 1e6})
                print(f"batch {batch:3d} lengths {lo}-{hi} {order:13s} tokens {tokens:3d} f16 {f16_kv:d}: {us:8.1f} us "
                      f"({kv_bytes / us / 1e6:.2f} TB/s)", flush=True)
            pools = None
            torch.cuda.empty_cache()
    save({"device": torch.cuda.get_device_name(dev), "kv_dtype": str(kv_dtype), "ragged": results}, json_path)


if __name__ == "__main__":
    main()
