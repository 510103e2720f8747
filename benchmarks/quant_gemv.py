"""Issue 25: the quantized-weight kernels against bf16 on Llama-3-8B's linear shapes, one GPU.

Decode (1-16 rows): per layer shape, the time of one matmul inside a CUDA graph of back-to-back
calls that rotate over enough weight copies to miss the L2 cache, for bf16 (cuBLAS and the Triton
GEMV), FP8 (`torch._scaled_mm` with its per-token activation quantization, the FP8 GEMV's loops:
"runs", "runs8" and, for comparison, session 15's best "dot16" and "fma" settings) and INT4 W4A16
(the tensor-core GEMV of triton_w4a16_gemv.py with its "mma" and "mmak" loops, the FMA GEMV, the
tensor-core kernel for 4-16 rows) and FP4 (its GEMV, its matmul's two forms), with the achieved
weight bandwidth. `--sweep` also tries the kernels' tile settings; `--warm` only compiles them (run
one process per shape and row count side by side to fill Triton's cache before a timed sweep).
Prefill and 17-64 rows (`--prefill-rows`, default 64-4096; `--prefill-shapes`): the INT4 and FP4
tensor-core kernels against dequantize-then-cuBLAS, FP8 `_scaled_mm` and bf16 cuBLAS.

    python3 benchmarks/quant_gemv.py [--sweep [--write-configs]] [--json out.json] [--shapes qkv,o]
        [--only runs8,mmak] [--warm] [--prefill-rows 32,64 --prefill-shapes qkv,o,gate_up,down]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from shardserve.kernels.gemv import triton_gemv
from shardserve.kernels.quant import (
    int4_layout,
    triton_fp4,
    triton_fp4_gemv,
    triton_fp8_gemv,
    triton_w4a16,
    triton_w4a16_gemv,
    tuned,
)
from shardserve.quantization.fp8 import quantize_rows, quantize_tokens

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (14336, 4096, True),
          "down": (4096, 14336, False)}   # (N, K, gated): the gated weight is [2N, K]
GROUP, RUN = 128, 128


def graph_time(fn, weights: list, reps: int = 20) -> float:
    """Seconds per call: a CUDA graph of one call per weight copy, replayed `reps` times."""
    torch.cuda.synchronize()
    for w in weights[:2]:
        fn(w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in weights:
            fn(w)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / reps / len(weights))
    return sorted(times)[1]


def copies(nbytes: int) -> int:
    return max(2, -(-160 * 2 ** 20 // nbytes))   # 160 MiB of weights per graph: past the 50 MB L2


def make_weights(n: int, k: int, gated: bool):
    rows = 2 * n if gated else n
    bf = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 0.02
    fp8, scale = quantize_rows(bf)
    q = torch.randint(0, 16, (k, rows), dtype=torch.int32, device="cuda")
    groups = -(-k // GROUP)
    words = int4_layout.pack(q, RUN)
    s = (torch.rand(groups, rows, device="cuda") * 0.004 + 0.001).half()
    z = torch.randint(0, 16, (groups, rows), dtype=torch.uint8, device="cuda")
    packed = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, device="cuda")   # NVFP4: E4M3 scales
    fp4_scales = (torch.rand(rows, k // 16, device="cuda") + 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
    fp4 = (triton_fp4.repack(packed), fp4_scales, torch.full((rows,), 0.01, device="cuda"))
    return {"bf16": bf, "fp8": (fp8, scale), "int4": (words, s, z), "fp4": fp4}


def replicate(w, c: int):
    if isinstance(w, tuple):
        return [tuple(t.clone() for t in w) for _ in range(c)]
    return [w.clone() for _ in range(c)]


def nbytes(w) -> int:
    return sum(t.numel() * t.element_size() for t in (w if isinstance(w, tuple) else (w,)))


FP8_OLD = [("fma", 8, 512, 4, 1), ("dot16", 32, 512, 4, 4), ("dot16", 32, 256, 4, 4), ("dot16", 64, 256, 4, 4)]
# (loop, BLOCK_N, run length, warps, stages, split-K parts); 16 rows a warp
FP8_RUNS = [("runs", 32, 64, 2, 3, 1), ("runs", 32, 64, 2, 3, 2), ("runs", 32, 128, 2, 3, 1), ("runs", 16, 64, 1, 4, 1),
            ("runs8", 32, 64, 2, 3, 1), ("runs8", 32, 64, 2, 4, 1), ("runs8", 16, 64, 1, 4, 1),
            ("runs8", 32, 128, 2, 3, 1), ("runs8", 16, 128, 1, 3, 1)]
INT4_FMA = [(4, 1), (8, 2)]
# (loop, BLOCK_N, words a step, split-K parts, warps, stages); "mmak": RUN // STEP warps
INT4_MMA = [("mma", 32, 32, 1, 2, 3), ("mma", 16, 32, 1, 1, 3), ("mma", 32, 64, 1, 2, 3), ("mma", 16, 32, 2, 1, 3),
            ("mma", 64, 32, 4, 4, 2), ("mmak", 16, 64, 1, 2, 3), ("mmak", 16, 64, 1, 2, 4), ("mmak", 16, 64, 2, 2, 3),
            ("mmak", 16, 32, 1, 4, 3), ("mmak", 32, 32, 1, 4, 3), ("mmak", 16, 32, 2, 4, 3), ("mmak", 32, 64, 1, 2, 2)]
INT4_DOT = [(16, 64, 4, 2), (16, 64, 4, 3)]
# (BLOCK_N, blocks side by side = warps, split-K parts, stages)
FP4_GEMV = [(16, 2, 1, 3), (16, 4, 1, 3), (16, 4, 1, 4), (16, 8, 1, 3), (16, 4, 2, 3), (16, 2, 2, 4), (32, 4, 1, 3),
            (16, 8, 2, 2), (32, 8, 1, 2), (16, 4, 4, 3)]
# (BLOCK_M, BLOCK_N, warps, stages, split-K parts) of triton_fp4.matmul
FP4_DOT = [(16, 32, 2, 3, 1), (16, 32, 2, 3, 2), (16, 32, 2, 3, 4), (16, 16, 1, 3, 2), (16, 64, 4, 3, 2),
           (16, 64, 4, 3, 4)]


def decode_variants(rows: int, n: int, k: int, gated: bool, sweep: bool):
    """name -> (format, fn(x, weight), config key or None, tiles)"""
    def silu_mul(y):
        return F.silu(y[:, :n]) * y[:, n:]

    v = {"bf16 cuBLAS": ("bf16", lambda x, w: silu_mul(F.linear(x, w)) if gated else F.linear(x, w), None, None),
         "bf16 triton": ("bf16", lambda x, w: triton_gemv.gemv(x, w, gated=gated), None, None)}

    def scaled_mm(x, w):
        xq, xs = quantize_tokens(x)
        y = torch._scaled_mm(xq, w[0].t(), scale_a=xs, scale_b=w[1].view(1, -1), out_dtype=x.dtype)
        return silu_mul(y) if gated else y

    fp8_key = tuned.key("fp8", n, k, gated, rows)
    v["fp8 _scaled_mm"] = ("fp8", scaled_mm, fp8_key, ["scaled_mm"])
    v["fp8 gemv default"] = ("fp8", lambda x, w: triton_fp8_gemv.gemv(x, w[0], w[1], gated=gated), None, None)
    fp8_tiles = []
    if sweep:
        fp8_tiles += [t for t in FP8_OLD if rows <= 4 or t[0] != "fma"]
        fp8_tiles += FP8_RUNS if rows <= triton_fp8_gemv.RUNS_ROWS else []
    for t in fp8_tiles:
        v[f"fp8 gemv {t}"] = ("fp8", lambda x, w, t=t: triton_fp8_gemv.gemv(x, w[0], w[1], gated=gated, tiles=t),
                              fp8_key, list(t))

    args = (k, GROUP, RUN)
    if rows <= triton_w4a16_gemv.MAX_ROWS:
        gemv_key = tuned.key("int4_mma", n, k, gated, rows)
        v["int4 gemv default"] = ("int4", lambda x, w: triton_w4a16_gemv.gemv(x, *w, *args, gated=gated), None, None)
        tiles = [("fma", *t) for t in INT4_FMA] + INT4_MMA if sweep else []
        for t in tiles:
            v[f"int4 gemv {t}"] = ("int4", lambda x, w, t=t: triton_w4a16_gemv.gemv(x, *w, *args, gated=gated, tiles=t),
                                   gemv_key, list(t))
    if rows <= triton_fp4_gemv.MAX_ROWS:
        v["fp4 gemv default"] = ("fp4", lambda x, w: triton_fp4_gemv.gemv(x, *w, "nvfp4", k, gated=gated), None, None)
        for t in FP4_GEMV if sweep else []:
            v[f"fp4 gemv {t}"] = ("fp4", lambda x, w, t=t: triton_fp4_gemv.gemv(x, *w, "nvfp4", k, gated=gated,
                                                                                tiles=t), None, list(t))
    if rows >= 4:
        for t in [None] + (FP4_DOT if sweep else []):
            for first, tag in ((False, "dot"), (True, "dot scale-first")):
                v[f"fp4 {tag} {t or 'default'}"] = ("fp4", lambda x, w, t=t, first=first: (
                    silu_mul if gated else (lambda y: y))(triton_fp4.matmul(x, *w, None, "nvfp4", k, tiles=t,
                                                                            scale_first=first)), None, list(t or ()))
    if rows >= 4:
        dot_key = tuned.key("int4_dot", 2 * n if gated else n, k, False, rows)

        def dot(x, w, t=None):
            y = triton_w4a16.matmul_dot(x, *w, *args, tiles=t)
            return silu_mul(y) if gated else y

        v["int4 dot default"] = ("int4", dot, None, None)
        for t in INT4_DOT if sweep else []:
            v[f"int4 dot {t}"] = ("int4", lambda x, w, t=t: dot(x, w, t), dot_key, list(t))
        v["int4 dequantize+cuBLAS"] = ("int4", lambda x, w: (silu_mul if gated else (lambda y: y))(
            F.linear(x, triton_w4a16.dequantize(*w, *args, torch.bfloat16))), None, None)
    return v


def warm(sweep: bool, rows_list: list[int], shapes: list[str]) -> None:
    """Compile every variant once (no timing, no weight copies): fills Triton's cache."""
    for name in shapes:
        n, k, gated = SHAPES[name]
        base = make_weights(n, k, gated)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            for label, (fmt, fn, _, _) in decode_variants(rows, n, k, gated, sweep).items():
                try:
                    fn(x, base[fmt])
                except Exception as e:
                    print(f"warm {name} rows {rows} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.synchronize()


def run_decode(sweep: bool, rows_list: list[int], on_shape=None, shapes: list[str] = tuple(SHAPES),
               only: list[str] = ()) -> list[dict]:
    results = []
    for name in shapes:
        n, k, gated = SHAPES[name]
        base = make_weights(n, k, gated)
        pools = {fmt: replicate(w, copies(nbytes(w))) for fmt, w in base.items()}
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            for label, (fmt, fn, key, tiles) in decode_variants(rows, n, k, gated, sweep).items():
                if only and not any(part in label for part in only):
                    continue
                try:
                    t = graph_time(lambda w, fn=fn: fn(x, w), pools[fmt])
                except Exception as e:   # a tile setting the compiler refuses: noted, not fatal
                    print(f"{name} rows {rows} {label}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                gbs = nbytes(base[fmt]) / t / 1e9
                results.append({"shape": name, "rows": rows, "variant": label, "format": fmt, "us": t * 1e6,
                                "weight_gb_s": gbs, "key": key, "tiles": tiles})
                print(f"  {name} rows {rows} {label}: {t * 1e6:.1f} us {gbs:.0f} GB/s", flush=True)
        if on_shape:   # what is measured so far is kept even if a time limit cuts the run
            on_shape(results)
        del pools, base
        torch.cuda.empty_cache()
    return results


def best_configs(decode: list[dict]) -> dict[str, list]:
    """The fastest tiles per config key (fp8: `scaled_mm` where it beat every GEMV setting)."""
    best: dict[str, dict] = {}
    for r in decode:
        if r["key"] and (r["key"] not in best or r["us"] < best[r["key"]]["us"]):
            best[r["key"]] = r
    return {key: r["tiles"] for key, r in sorted(best.items())}


# (BLOCK_M, BLOCK_N, warps, stages) of the tensor-core W4A16 kernel on prefill row counts
INT4_DOT_PREFILL = [(16, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3),
                    (64, 128, 8, 3), (128, 128, 4, 3)]
# the same with split-K parts, for 17-64 rows (one row tile)
INT4_DOT_MID = [(32, 32, 4, 2, 4), (32, 32, 4, 2, 2), (32, 64, 4, 2, 4), (64, 32, 4, 2, 4), (64, 32, 4, 1, 4),
                (64, 64, 4, 1, 4)]
# (BLOCK_M, BLOCK_N, warps, stages, split) of the FP4 matmul (weights scaled first) on prefill row counts
FP4_DOT_PREFILL = [(64, 64, 4, 3, 1), (64, 64, 4, 3, 2), (64, 64, 4, 3, 4), (32, 64, 4, 3, 4), (128, 64, 4, 3, 1),
                   (128, 64, 4, 3, 2), (128, 128, 8, 3, 1), (256, 128, 8, 3, 1), (32, 32, 2, 3, 4), (64, 32, 4, 3, 4)]


def int4_weight(n: int, k: int, group: int, run: int) -> tuple:
    q = torch.randint(0, 16, (k, n), dtype=torch.int32, device="cuda")
    s = (torch.rand(-(-k // group), n, device="cuda") * 0.004 + 0.001).half()
    z = torch.randint(0, 16, s.shape, dtype=torch.uint8, device="cuda")
    return int4_layout.pack(q, run), s, z



def run_prefill(rows_list: list[int], sweep: bool = False, shapes: tuple[str, ...] = ("qkv", "down"),
                only: list[str] = ()) -> list[dict]:
    results = []
    for name in shapes:
        n, k, _ = SHAPES[name]
        base = make_weights(n, k, False)
        g32 = int4_weight(n, k, 32, 32)   # GGUF Q4_0 / Q4_1 / Q4_K's groups
        pools = {fmt: replicate(w, copies(nbytes(w))) for fmt, w in (*base.items(), ("g32", g32))}
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

            def scaled_mm(w):
                xq, xs = quantize_tokens(x)
                return torch._scaled_mm(xq, w[0].t(), scale_a=xs, scale_b=w[1].view(1, -1), out_dtype=x.dtype)

            variants = {"bf16 cuBLAS": ("bf16", lambda w: F.linear(x, w)), "fp8 _scaled_mm": ("fp8", scaled_mm),
                        "int4 dequantize+cuBLAS": ("int4", lambda w: F.linear(
                            x, triton_w4a16.dequantize(*w, k, GROUP, RUN, torch.bfloat16))),
                        "int4 g32 dequantize+cuBLAS": ("g32", lambda w: F.linear(
                            x, triton_w4a16.dequantize(*w, k, 32, 32, torch.bfloat16)))}
            variants["fp4 dequantize+cuBLAS"] = ("fp4", lambda w: F.linear(
                x, triton_fp4.dequantize(*w, "nvfp4", k, torch.bfloat16)))
            for t in [None] + (FP4_DOT_PREFILL if sweep else []):
                variants[f"fp4 dot {t or 'default'}"] = ("fp4", lambda w, t=t: triton_fp4.matmul(
                    x, *w, None, "nvfp4", k, tiles=t))
            for t in [None] + ((INT4_DOT_MID if rows <= 64 else INT4_DOT_PREFILL) if sweep else []):
                variants[f"int4 dot {t or 'default'}"] = ("int4", lambda w, t=t: triton_w4a16.matmul_dot(
                    x, *w, k, GROUP, RUN, tiles=t))
                variants[f"int4 g32 dot {t or 'default'}"] = ("g32", lambda w, t=t: triton_w4a16.matmul_dot(
                    x, *w, k, 32, 32, tiles=t))
            for label, (fmt, fn) in variants.items():
                if only and not any(part in label for part in only):
                    continue
                try:
                    t = graph_time(fn, pools[fmt], reps=5)
                except Exception as e:
                    print(f"prefill {name} rows {rows} {label}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                results.append({"shape": name, "rows": rows, "variant": label, "format": fmt, "us": t * 1e6,
                                "tflops": 2 * rows * n * k / t / 1e12})
                print(f"  prefill {name} rows {rows} {label}: {t * 1e6:.1f} us", flush=True)
        del base, g32, pools
        torch.cuda.empty_cache()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep", action="store_true", help="also try the kernels' tile settings")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--prefill-rows", default="64,256,1024,4096")
    p.add_argument("--prefill-shapes", default="qkv,down")
    p.add_argument("--json", default=None)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--only", default="", help="time only the variants whose names hold one of these "
                   "comma-separated parts (e.g. 'runs8,mmak,bf16 triton')")
    p.add_argument("--warm", action="store_true", help="only compile the variants (fills Triton's cache)")
    p.add_argument("--write-configs", action="store_true",
                   help="write the fastest tiles into shardserve/kernels/quant/configs/ for this GPU")
    ns = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    def save(decode: list[dict], prefill: list[dict] = ()) -> None:
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "decode": decode, "prefill": list(prefill)}, f,
                          indent=1)
        if ns.write_configs:
            tuned.write(best_configs(decode), torch.cuda.get_device_name())

    rows_list, shapes = [int(r) for r in ns.rows.split(",") if r], ns.shapes.split(",")
    if ns.warm:
        warm(ns.sweep, rows_list, shapes)
        return
    decode = run_decode(ns.sweep, rows_list, save, shapes, [part for part in ns.only.split(",") if part])
    only = [part for part in ns.only.split(",") if part]
    prefill = (run_prefill([int(r) for r in ns.prefill_rows.split(",")], ns.sweep, tuple(ns.prefill_shapes.split(",")),
                           only) if ns.prefill_rows else [])
    save(decode, prefill)
    for (shape, rows) in dict.fromkeys((r["shape"], r["rows"]) for r in decode):
        rs = [r for r in decode if r["shape"] == shape and r["rows"] == rows]
        best = {}
        for r in rs:
            if r["format"] not in best or r["us"] < best[r["format"]]["us"]:
                best[r["format"]] = r
        line = "; ".join(f"{f}: {b['us']:.1f} us {b['weight_gb_s']:.0f} GB/s [{b['variant']}]" for f, b in best.items())
        print(f"{shape:8s} rows {rows:2d}  {line}")
        for fmt in best:
            ranked = sorted((r for r in rs if r["format"] == fmt), key=lambda r: r["us"])
            shown = ranked if not ns.sweep else ranked[:3] + [r for r in ranked[3:] if "default" in r["variant"]
                                                               or "cuBLAS" in r["variant"] or "_scaled" in r["variant"]]
            for r in shown:
                print(f"    {r['variant']:34s} {r['us']:8.1f} us {r['weight_gb_s']:6.0f} GB/s")
    for r in prefill:
        print(f"prefill {r['shape']:5s} rows {r['rows']:5d} {r['variant']:30s} {r['us']:9.1f} us "
              f"{r['tflops']:6.1f} TF/s")


if __name__ == "__main__":
    main()
