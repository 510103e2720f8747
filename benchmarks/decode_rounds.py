"""Issue 25's batch-1 ratios in one command: `bench latency` on a built-in shape in bf16 and in
quantized formats (compressed-tensors configs written on that shape, random weights), in alternating
rounds, each run in its own process, and every format's decode step against bf16's of the same round.
Rounds alternate because the step drifts between calls and machines (BENCHMARKS.md, session 32).

    python3 benchmarks/decode_rounds.py --shape llama-3-8b --formats bf16,fp8-head,w8a8-head,w4a16-head \
        --rounds 4 --num-iters 10 --json out.json

Formats: bf16 (the shape as it is); fp8, fp8-head (compressed-tensors FP8 per channel, dynamic
per-token activations; -head: the LM head in FP8 too, `ignore: []`, for shapes with an untied head
such as llama-3-8b); w8a8, w8a8-head (INT8 per
channel, per-token activations); w4a16, w4a16-head (INT4 group 128, symmetric); nvfp4, nvfp4-head
(llm-compressor's NVFP4A16: E2M1 weights, E4M3 scales per 16 inputs, kernels/quant/triton_fp4.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve.bench.shapes import shape_config  # noqa: E402

_WEIGHTS = {
    "fp8": ({"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False},
            {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True},
            "float-quantized"),
    "w8a8": ({"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False},
             {"type": "int", "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True},
             "int-quantized"),
    "w4a16": ({"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True,
               "dynamic": False}, None, "pack-quantized"),
    "nvfp4": ({"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16, "symmetric": True,
               "dynamic": False}, None, "nvfp4-pack-quantized"),
}


def quantized_config(shape: str, fmt: str) -> dict:
    """The shape's config with a compressed-tensors `quantization_config` for `fmt` (see the module
    docstring), as llm-compressor writes one."""
    weights, inputs, layout = _WEIGHTS[fmt.removesuffix("-head")]
    config = shape_config(shape)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": layout, "quantization_status": "compressed",
        "ignore": [] if fmt.endswith("-head") else ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}}}
    return config


def run_once(source: str, args: argparse.Namespace, out: str) -> dict:
    cmd = [sys.executable, "-m", "shardserve", "bench", "latency", "--random-weights", source, "--batch-size", "1",
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--num-iters", str(args.num_iters), "--output-json", out, *shlex.split(args.bench_args)]
    subprocess.run(cmd, check=True)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--formats", default="bf16,fp8-head", help="comma-separated; bf16 first is the reference")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-iters", type=int, default=10)
    ap.add_argument("--bench-args", default="", help="more `bench latency` flags, e.g. \"-tp 2\" or, on a CPU, "
                    "\"--max-model-len 512\"")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    formats = args.formats.split(",")
    unknown = [f for f in formats if f != "bf16" and f.removesuffix("-head") not in _WEIGHTS]
    if unknown or "bf16" not in formats:
        ap.error(f"--formats needs bf16 and takes {', '.join(['bf16', *_WEIGHTS])} (with -head): not {unknown}")
    tmp = tempfile.mkdtemp(prefix="decode-rounds-")
    sources = {}
    for fmt in formats:
        if fmt == "bf16":
            sources[fmt] = args.shape
            continue
        sources[fmt] = os.path.join(tmp, f"{fmt}.json")
        with open(sources[fmt], "w") as f:
            json.dump(quantized_config(args.shape, fmt), f)
    steps: dict[str, list[float]] = {fmt: [] for fmt in formats}
    rows = []
    for r in range(args.rounds):
        for fmt in formats:
            result = run_once(sources[fmt], args, os.path.join(tmp, f"r{r}_{fmt}.json"))
            steps[fmt].append(result["decode_step_ms"])
            rows.append({"round": r + 1, "format": fmt, "decode_step_ms": result["decode_step_ms"],
                         "prefill_ms": result["prefill_s"] * 1000, "roofline_step_ms": result["roofline_step_ms"],
                         "device": result.get("device"), "dtype": result.get("dtype")})
        ratios = "  ".join(f"{fmt} {steps['bf16'][-1] / steps[fmt][-1]:.3f}x" for fmt in formats if fmt != "bf16")
        print(f"round {r + 1}: bf16 {steps['bf16'][-1]:.3f} ms  {ratios}", flush=True)
    summary = {fmt: {"median_step_ms": statistics.median(v),
                     "ratio_to_bf16": [b / s for b, s in zip(steps["bf16"], v)]} for fmt, v in steps.items()}
    for fmt, s in summary.items():
        print(f"{fmt:>11}: median step {s['median_step_ms']:.3f} ms, against bf16 "
              f"{min(s['ratio_to_bf16']):.3f}-{max(s['ratio_to_bf16']):.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
