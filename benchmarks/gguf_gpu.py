"""Issue 25: GGUF weights kept in their blocks on one GPU (kernels/quant/triton_gguf.py).

    python3 benchmarks/gguf_gpu.py [--layers [--sweep]] [--model q4_k_m,q4_k,q4_0] [--types Q4_K,Q6_K]
        [--moe] [--moe-model] [--json out.json]

`--layers`: per Llama-3-8B linear shape and GGUF type, the time of one matmul at 1 and 4 rows
inside a CUDA graph of back-to-back calls rotating over enough weight copies to miss the L2 cache
(benchmarks/quant_gemv.py's harness), the weight held as a layer holds it (`gguf_layout.gpu_weight`:
planes, Q4_0 / Q4_1 / Q4_K in the W4A16 layout) and multiplied as a layer multiplies it
(`kernels/quant/gguf_matmul.py`),
beside the bf16 Triton GEMV (1-4 rows) and cuBLAS; GB/s = the bytes the weight holds over the time;
the run's copy bandwidth. `--sweep` also times the planes GEMV's settings (strip width, warps,
inputs per step, pipeline stages, loop).

`--model`: random-weight Llama-3-8B-shaped GGUF files written here (blocks of random bytes with
small scales; `q4_k_m`: Q4_K, with attn_v and ffn_down in Q6_K in every third layer as llama.cpp's
Q4_K_M mixes them; `q4_k`: Q4_K only; `q4_0`: Q4_0; the LM head Q6_K), then `shardserve bench
latency` (batch 1, 128 tokens in, 64 out) on each as the defaults keep it (q4_k_m also with
SHARDSERVE_GGUF_DEQUANTIZE=0: every type in blocks), beside `--random-weights llama-3-8b` in bf16
(what a file dequantized at load runs, without the minutes gguf-py takes to expand 8B weights),
each in a fresh process; the file roofline is every byte of the file's linears and LM head a
decode step reads over the run's copy bandwidth.

`--moe`: one fused-MoE layer of Qwen3-30B-A3B's expert shapes (128 experts, hidden 2048,
intermediate 768, top-8), random Q4_0 / Q4_1 / Q4_K experts kept as CUDA keeps them
(`int4_experts.from_gguf_blocks`) and random GPTQ-style ones (group 128), each by the INT4 MoE's
vector kernel and by its tiles, against the Q4_K experts dequantized to bf16 (what a GGUF MoE ran
before, and any bf16 checkpoint runs: the fused bf16 MoE kernel), at 1 to 512 tokens; inside a CUDA
graph over 8 random routings, so a call reads other experts than the last.

`--moe-model`: a random-weight Qwen3-30B-A3B-shaped GGUF file (attention, experts and embedding
Q4_K, LM head Q6_K) written here, then `shardserve bench latency` (batch 1, 128 in / 64 out) on it as
the defaults keep it (experts and attention 4-bit), beside `--random-weights qwen3-30b-a3b` in bf16,
each in a fresh process.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from quant_gemv import copies, graph_time  # noqa: E402

from shardserve.kernels.gemv import triton_gemv  # noqa: E402
from shardserve.kernels.moe import int4_experts, reference, triton_moe, triton_moe_int4  # noqa: E402
from shardserve.kernels.quant import gguf_layout, gguf_matmul, triton_gguf  # noqa: E402

ROWS = (1, 4)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LLAMA3_8B = dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256)
# (BLOCK_N, warps, inputs per loop step, pipeline stages, loop) of the GEMV
SETTINGS = [(16, 4, 512, 4, 0), (64, 4, 256, 3, 1), (16, 4, 512, 3, 2), (32, 4, 512, 3, 2), (64, 4, 512, 3, 2),
            (32, 8, 512, 3, 2)]


def random_blocks(n: int, k: int, type_name: str, device: str = "cuda") -> torch.Tensor:
    """uint8 [n, blocks, bytes] of random quants with small fp16 scales (sane values, no inf)."""
    values, nbytes = gguf_layout.BLOCKS[type_name]
    raw = torch.randint(0, 256, (n, k // values, nbytes), dtype=torch.uint8, device=device)
    scale = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8).to(device)
    at = {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q4_1": (0, 2)}.get(type_name, (0,))
    for offset in at:
        raw[:, :, offset:offset + 2] = scale
    return raw


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / graph_time(lambda w: y.copy_(w), [x], reps=5)


def _copies(weight, count: int) -> list:
    return [weight] + [dataclasses.replace(weight, planes={key: p.clone() for key, p in weight.planes.items()})
                       for _ in range(count - 1)]


def layers(types: list[str], sweep: bool) -> dict:
    out = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": copy_bandwidth() / 1e9, "shapes": {}}
    for shape, (n, k) in SHAPES.items():
        bf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(copies(n * k * 2))]
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"cublas_us": graph_time(lambda w: F.linear(x, w), bf) * 1e6}
            if rows <= 4:
                row["bf16_gemv_us"] = graph_time(lambda w: triton_gemv.gemv(x, w), bf) * 1e6
            row["bf16_gbs"] = n * k * 2 / min(v for v in row.values()) / 1e3
            for type_name in types:
                raw = random_blocks(n, k, type_name)
                weight = gguf_layout.gpu_weight(raw, type_name, k)   # as a layer holds it (4-bit: W4A16 layout)
                held = sum(p.numel() * p.element_size() for p in weight.planes.values())
                ws = _copies(weight, copies(held))
                t = graph_time(lambda w: gguf_matmul.matmul(x, [(slice(0, n), w)], n), ws)
                entry = {"us": t * 1e6, "gbs": held / t / 1e9, "bits_per_weight": 8 * held / (n * k)}
                if sweep:   # the planes kernels' settings
                    ws = _copies(gguf_layout.to_planes(raw, type_name, k), len(ws))
                    entry["sweep_us"] = {f"{b},{wp}w,{sv},{st}s,loop{lp}": graph_time(
                        lambda w: triton_gguf.gemv(x, w, tiles=(b, wp, sv, st, lp)), ws) * 1e6
                        for b, wp, sv, st, lp in SETTINGS}
                row[type_name] = entry
                del ws, weight
            out["shapes"][f"{shape}:{rows}"] = row
            print(shape, rows, json.dumps(row), flush=True)
        del bf
        torch.cuda.empty_cache()
    return out


def _tensor_type(kind: str, name: str, layer: int) -> str:
    """q4_k_m: Q4_K with attn_v and ffn_down Q6_K in every third layer; q4_k: Q4_K; q4_0: Q4_0; the
    LM head Q6_K."""
    if name == "output.weight":
        return "Q6_K"
    if kind in ("q4_0", "q4_k"):
        return kind.upper()
    if layer % 3 == 0 and name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K"
    return "Q4_K"


def write_model(path: str, kind: str) -> int:
    """The random-weight 8B-shaped file of `kind` (module docstring); returns the bytes a decode step
    reads from its linears and LM head."""
    from tests.models import gguf_files
    return gguf_files.write_random_llama(
        path, LLAMA3_8B, lambda name, layer: _tensor_type(kind, name, layer),
        lambda rows, cols, qtype: random_blocks(rows, cols, qtype, device="cpu").numpy().reshape(rows, -1),
        rope_theta=500000.0, max_positions=8192)


def latency(args: list[str], env: dict) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "shardserve", "bench", "latency", *args, "--batch-size", "1", "--input-len",
               "128", "--output-len", "64", "--output-json", f.name]
        subprocess.run(cmd, env={**os.environ, **env}, check=True)
        with open(f.name) as g:
            return json.load(g)


def model(kinds: list[str]) -> dict:
    bw = copy_bandwidth()
    torch.cuda.empty_cache()   # the GPU's memory to the child processes
    out = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": bw / 1e9}
    # KV read per step at 160 tokens on average, 8 KV heads of 128, 32 layers, bf16: small beside the weights.
    kv = 160 * 2 * LLAMA3_8B["layers"] * LLAMA3_8B["kv_heads"] * 128 * 2
    for kind in kinds:
        path = os.path.join(tempfile.gettempdir(), f"random-llama-3-8b-{kind}.gguf")
        read = write_model(path, kind)
        # the default (Q4_0 / Q4_1 / Q4_K kept, Q4_K_M's Q6_K rows dense), and every type kept (=0)
        for label, env in (("default", {}), ("every type kept", {"SHARDSERVE_GGUF_DEQUANTIZE": "0"})):
            if label != "default" and kind != "q4_k_m":
                continue
            r = latency(["--model", path, "--dtype", "bfloat16"], env)
            out[f"gguf {kind} {label}"] = {"decode_step_ms": r["decode_step_ms"], "prefill_ms": r["prefill_s"] * 1e3,
                                           "file_linear_and_head_bytes": read,
                                           "file_roofline_ms": (read + kv) / bw * 1e3}
            print(kind, label, out[f"gguf {kind} {label}"], flush=True)
        os.remove(path)
    r = latency(["--random-weights", "llama-3-8b", "--dtype", "bfloat16"], {})
    bf16 = out["bf16 --random-weights llama-3-8b"] = {"decode_step_ms": r["decode_step_ms"],
                                                      "prefill_ms": r["prefill_s"] * 1e3}
    print("bf16", bf16, flush=True)
    return out


def _gptq_experts(experts: int, n: int, k: int, group: int = 128) -> int4_experts.Int4Experts:
    """Random GPTQ-style experts (uint8 zero points, fp16 scales, group 128) for comparison."""
    words = torch.stack([int4_experts.pack_along_k(torch.randint(0, 16, (n, k), device="cuda"))
                         for _ in range(experts)])
    scales = (torch.rand(experts, k // group, n, device="cuda") * 2e-3).half()
    zeros = torch.randint(6, 10, (experts, k // group, n), device="cuda", dtype=torch.uint8)
    index = (torch.arange(k, device="cuda", dtype=torch.int32) // group).expand(experts, k)
    return int4_experts.Int4Experts(words, scales, zeros, index, group_size=group)


def moe() -> dict:
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    out = {"device": torch.cuda.get_device_name(), "shape": dict(E=experts, H=hidden, I=inter, top_k=top_k),
           "rows": []}
    held = {}
    for type_name in gguf_layout.INT4_TYPES:
        w13 = int4_experts.from_gguf_blocks(random_blocks(experts * 2 * inter, hidden, type_name).view(
            experts, 2 * inter, -1), type_name, hidden, torch.device("cuda"))
        w2 = int4_experts.from_gguf_blocks(random_blocks(experts * hidden, inter, type_name).view(
            experts, hidden, -1), type_name, inter, torch.device("cuda"))
        held[type_name] = (w13, w2)
    held["GPTQ g128"] = (_gptq_experts(experts, 2 * inter, hidden), _gptq_experts(experts, hidden, inter))
    b13, b2 = (w.dequantize_all(torch.bfloat16) for w in held["Q4_K"])
    out["bytes"] = {"bf16": (b13.numel() + b2.numel()) * 2, **{
        t: sum(p.numel() * p.element_size() for w in ws for p in (w.qweight, w.scales, w.zeros))
        for t, ws in held.items()}}
    for tokens in (1, 2, 4, 8, 16, 64, 512):
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16) * 0.1
        routings = [reference.route_topk(torch.randn(tokens, experts, device="cuda"), top_k, True) for _ in range(8)]
        cfg = triton_moe.default_config(tokens, experts, top_k)
        bf16 = graph_time(lambda r: triton_moe.fused_moe(x, b13, b2, *r, config=cfg), routings)
        row = {"tokens": tokens, "bf16_us": bf16 * 1e6}
        for type_name, (w13, w2) in held.items():
            entry = row[type_name] = {}
            # the vector kernel (decode) and the tiles; the default picks by triton_moe_int4.VEC_PICKS
            for kernel, vec in (("vec", True), ("tiles", False)):
                if vec and tokens * top_k > 512:
                    continue
                t = graph_time(lambda r: triton_moe_int4.fused_moe(x, w13, w2, *r, config={**cfg, "VEC": vec}),
                               routings)
                entry[f"{kernel}_us"], entry[f"{kernel}_speedup"] = t * 1e6, bf16 / t
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(out["bytes"]), flush=True)
    # the vector kernel's tiles (BLOCK_N, BLOCK_K, warps, stages), Q4_K and GPTQ, 1 and 8 tokens
    default, out["vec_sweep"] = triton_moe_int4.VEC_TILES, {}
    for tokens in (1, 8):
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16) * 0.1
        routings = [reference.route_topk(torch.randn(tokens, experts, device="cuda"), top_k, True) for _ in range(8)]
        for tiles in ((16, 256, 4, 3), (32, 256, 4, 3), (16, 512, 4, 3), (32, 512, 8, 3), (64, 256, 8, 3),
                      (16, 256, 2, 3), (8, 256, 2, 4), (32, 128, 4, 4)):
            triton_moe_int4.VEC_TILES = tiles
            for type_name in ("Q4_K", "GPTQ g128"):
                w13, w2 = held[type_name]
                cfg = {**triton_moe.default_config(tokens, experts, top_k), "VEC": True}
                t = graph_time(lambda r: triton_moe_int4.fused_moe(x, w13, w2, *r, config=cfg), routings)
                out["vec_sweep"][f"{tokens} {type_name} {tiles}"] = t * 1e6
        print(json.dumps({k: round(v, 1) for k, v in out["vec_sweep"].items() if k.startswith(f"{tokens} ")}),
              flush=True)
    triton_moe_int4.VEC_TILES = default
    return out


def moe_model() -> dict:
    from shardserve.planner.catalog import model_config
    from tests.models import gguf_files
    bw = copy_bandwidth()
    torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": bw / 1e9}
    path = os.path.join(tempfile.gettempdir(), "random-qwen3-30b-a3b-q4_k.gguf")
    read = gguf_files.write_random_qwen3_moe(
        path, model_config("qwen3-30b-a3b"), lambda name, layer: "Q6_K" if name == "output.weight" else "Q4_K",
        lambda rows, cols, qtype: random_blocks(rows, cols, qtype, device="cpu").numpy().reshape(rows, -1))
    out["file_bytes"] = os.path.getsize(path)
    for label, args in (("gguf q4_k", ["--model", path]), ("bf16 --random-weights", ["--random-weights",
                                                                                    "qwen3-30b-a3b"])):
        r = latency([*args, "--dtype", "bfloat16"], {})
        out[label] = {k: r[k] for k in ("decode_step_ms", "prefill_s", "weight_gb_per_rank", "roofline_step_ms")}
        print(label, out[label], flush=True)
    out["gguf q4_k"]["file_roofline_ms"] = read / bw * 1e3   # weights a step reads (top-8 experts), no KV
    os.remove(path)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", action="store_true")
    p.add_argument("--sweep", action="store_true", help="--layers: also the planes kernels' settings")
    p.add_argument("--model", default=None, help="comma-separated files to write and time: q4_k_m, q4_k, q4_0")
    p.add_argument("--types", default=",".join(gguf_layout.TYPES))
    p.add_argument("--moe", action="store_true", help="one Qwen3-30B-A3B-shaped MoE layer, 4-bit experts kept")
    p.add_argument("--moe-model", action="store_true", help="a random Qwen3-30B-A3B-shaped Q4_K file, end to end")
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    result = {}
    if ns.layers:
        result["layers"] = layers(ns.types.split(","), ns.sweep)
    if ns.model:
        result["model"] = model(ns.model.split(","))
    if ns.moe:
        result["moe"] = moe()
    if ns.moe_model:
        result["moe_model"] = moe_model()
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
