"""Tune the Triton fused MoE's tiles for one layer shape and write them where get_config reads them.

    python benchmarks/tune_moe.py --num-experts 128 --hidden-size 2048 --intermediate-size 768 --top-k 8 \\
        --out-dir shardserve/kernels/moe/configs
    python benchmarks/tune_moe.py ... --bench 1,256     # fused vs a per-expert torch loop vs dense bmm

Per batch size M: for each BLOCK_M worth trying (the grouping is shared by both matmuls), the best
gate_up tiles and the best down tiles are timed apart (routing from random logits, weights flushed
from L2 between runs by triton.testing.do_bench), and the BLOCK_M with the smallest sum wins. The
search space is small on purpose: one shape takes a minute or two on an H100, most of it compiling.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

from shardserve.kernels.moe import reference, triton_moe
from shardserve.kernels.moe.align import moe_align

DEFAULT_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def block_m_candidates(m: int, top_k: int, num_experts: int) -> list[int]:
    per_expert = m * top_k / num_experts
    if per_expert <= 4:
        return [16]
    if per_expert <= 16:
        return [16, 32]
    if per_expert <= 64:
        return [32, 64]
    return [64, 128]


def tile_candidates(block_m: int) -> list[dict]:
    out = []
    for bn, bk, (warps, stages) in itertools.product((32, 64, 128), (64, 128), ((4, 3), (4, 4), (8, 3))):
        if block_m >= 128 and bn == 32:
            continue
        out.append(dict(BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1 if block_m <= 32 else 8,
                        num_warps=warps, num_stages=stages))
    return out


def _time(fn) -> float:
    """Milliseconds, or inf where the tiles don't fit (shared memory, registers)."""
    import triton
    try:
        fn()
        return triton.testing.do_bench(fn, warmup=5, rep=20)
    except Exception as exc:  # OutOfResources and compile errors both mean "not this config"
        if "out of resource" not in str(exc).lower() and "OutOfResources" not in type(exc).__name__:
            print(f"      config failed: {type(exc).__name__}: {str(exc)[:120]}")
        return float("inf")


def tune_batch(m: int, w13, w2, top_k: int) -> tuple[dict, float]:
    num_experts, hidden_size, inter = w13.shape[0], w13.shape[2], w2.shape[2]
    x = torch.randn(m, hidden_size, device="cuda", dtype=w13.dtype)
    weights, ids = reference.route_topk(torch.randn(m, num_experts, device="cuda"), top_k, True)
    act = torch.empty(m * top_k, inter, device="cuda", dtype=w13.dtype)
    y = torch.empty(m * top_k, hidden_size, device="cuda", dtype=w13.dtype)
    flat_w = weights.reshape(-1)
    best, best_ms = None, float("inf")
    for bm in block_m_candidates(m, top_k, num_experts):
        grouping = moe_align(ids, num_experts, bm)
        results = []
        for step, (a, b, c, w, a_div, gated) in enumerate(((x, w13, act, None, top_k, True),
                                                           (act, w2, y, flat_w, 1, False))):
            timed = [(_time(lambda cfg=dict(BLOCK_SIZE_M=bm, **t): triton_moe.moe_gemm(
                a, b, c, w, *grouping, a_div, gated, cfg)), t) for t in tile_candidates(bm)]
            results.append(min(timed, key=lambda r: r[0]))
        ms = results[0][0] + results[1][0]
        print(f"    M={m} BLOCK_M={bm}: gate_up {results[0][0] * 1e3:.1f} us {results[0][1]}, "
              f"down {results[1][0] * 1e3:.1f} us {results[1][1]}", flush=True)
        if ms < best_ms:
            best_ms = ms
            best = dict(BLOCK_SIZE_M=bm, **results[0][1], down={k: v for k, v in results[1][1].items()
                                                                if results[0][1].get(k) != v})
            if not best["down"]:
                del best["down"]
    return best, best_ms


def tune(args, w13, w2) -> None:
    device_name = torch.cuda.get_device_name()
    path = os.path.join(args.out_dir, triton_moe.config_file_name(args.num_experts, args.intermediate_size,
                                                                  device_name))
    table = {}
    for m in args.batch_sizes:
        t0 = time.time()
        cfg, ms = tune_batch(m, w13, w2, args.top_k)
        table[str(m)] = cfg
        print(f"  M={m}: {ms * 1e3:.1f} us (gate_up + down) in {time.time() - t0:.0f} s: {cfg}", flush=True)
        os.makedirs(args.out_dir, exist_ok=True)
        with open(path, "w") as f:   # after every M, so a run cut short still leaves what it found
            json.dump(table, f, indent=1)
    print(f"wrote {path}")


def _loop_moe(x, w13, w2, weights, ids):
    """What a plain framework does: one pair of bf16 matmuls per expert that got tokens (host syncs)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in ids.unique().tolist():
        if e < 0:
            continue
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        gu = x[tok] @ w13[e].t()
        y = (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w2[e].t()
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(x.dtype)


def bench(args, w13, w2) -> None:
    """Microseconds per layer call; the fused kernel also replayed from a CUDA graph (as in decode)."""
    from triton.testing import do_bench
    num_experts, top_k = args.num_experts, args.top_k
    per_expert_bytes = 3 * args.hidden_size * args.intermediate_size * w13.element_size()
    for m in args.bench:
        x = torch.randn(m, args.hidden_size, device="cuda", dtype=w13.dtype)
        weights, ids = reference.route_topk(torch.randn(m, num_experts, device="cuda"), top_k, True)
        fused = lambda: triton_moe.fused_moe(x, w13, w2, weights, ids)
        fused()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused()
        # Dense upper bound: the same bytes as a batched matmul over the experts hit, tokens split evenly.
        hit = ids.unique().numel()
        per = -(-m * top_k // hit)
        xd = torch.randn(hit, per, args.hidden_size, device="cuda", dtype=w13.dtype)
        w13d, w2d = w13[:hit].transpose(1, 2), w2[:hit].transpose(1, 2)

        def dense():
            gu = torch.bmm(xd, w13d)
            return torch.bmm(F.silu(gu[..., :args.intermediate_size]) * gu[..., args.intermediate_size:], w2d)
        us = {name: do_bench(fn, warmup=10, rep=100) * 1e3 for name, fn in
              (("fused_eager", fused), ("fused_graph", graph.replay), ("torch_loop", lambda: _loop_moe(
                  x, w13, w2, weights, ids)), ("dense_bmm", dense))}
        roofline = hit * per_expert_bytes / 3000e9 * 1e6
        print(f"T={m}: experts hit {hit}, bytes-read roofline at 3000 GB/s {roofline:.1f} us | "
              + " | ".join(f"{k} {v:.1f} us" for k, v in us.items()), flush=True)
        del graph


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--intermediate-size", type=int, default=768, help="this rank's (TP-sharded) size")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--batch-sizes", type=lambda s: [int(v) for v in s.split(",")], default=DEFAULT_BATCHES)
    p.add_argument("--out-dir", default=triton_moe.CONFIG_DIR)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--bench", type=lambda s: [int(v) for v in s.split(",")], default=None,
                   help="time these batch sizes with the current configs instead of tuning")
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    e, h, i = args.num_experts, args.hidden_size, args.intermediate_size
    w13 = (torch.randn(e, 2 * i, h, device="cuda") / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda") / i ** 0.5).to(dtype)
    print(f"E={e} H={h} I={i} top-{args.top_k} {args.dtype} on {torch.cuda.get_device_name()}", flush=True)
    bench(args, w13, w2) if args.bench else tune(args, w13, w2)


if __name__ == "__main__":
    main()
