"""GGUF kept quantized vs dequantized at load on the CPU (issue 25): the embedded SmolLM2-135M Q4_1,
each path in a fresh process with 2 threads, in one run.

    .venv/bin/python benchmarks/gguf_cpu.py [--rounds 2] [--dtype bfloat16] [--json out.json]

Per path: the weights the model holds (the runner's "Model loading took" figure), single-stream
decode (a 128-token random prompt, 128 new tokens, ignore_eos; tok/s of the decode steps after the
first token), offline throughput (16 random prompts of 64-256 tokens, 128 new tokens each), and the
greedy answer to the France question. Paths alternate over `--rounds`; the best round is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

THREADS = "2"
PATHS = {   # name: environment
    "kept quantized (best ISA)": {"SHARDSERVE_GGUF_DEQUANTIZE": "0"},
    "kept quantized, AVX2": {"SHARDSERVE_GGUF_DEQUANTIZE": "0", "SHARDSERVE_CPU_ISA": "avx2"},
    "dequantized at load": {"SHARDSERVE_GGUF_DEQUANTIZE": "1"},
}


def measure(dtype: str) -> dict:
    """Runs in the child process: benchmarks/cpu_paths.py's measurements, 16 offline prompts."""
    import torch
    from cpu_paths import measure as measure_path  # this directory is on the path of a script
    torch.set_num_threads(int(THREADS))
    return measure_path(dtype, num_prompts=16)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(measure(sys.argv[2])))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from shardserve.kernels.cpu import quant_ops
    paths = {name: env for name, env in PATHS.items()
             if env.get("SHARDSERVE_CPU_ISA") in (None, *quant_ops.cpu_isas())}
    results: dict[str, list[dict]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, env in paths.items():
            env = {**os.environ, "OMP_NUM_THREADS": THREADS, **env}
            out = subprocess.run([sys.executable, __file__, "--child", args.dtype], env=env, capture_output=True,
                                 text=True, check=True).stdout
            results[name].append(json.loads(out.split("RESULT ", 1)[1]))
    best = {name: max(rounds, key=lambda r: r["decode_tok_s"]) | {
        "offline_tok_s": max(r["offline_tok_s"] for r in rounds),
        "prefill_128_ms": min(r["prefill_128_ms"] for r in rounds)} for name, rounds in results.items()}
    print(f"{args.dtype}, {THREADS} threads, best ISA here: {quant_ops.isa()}")
    print("| path | weights GiB | decode tok/s | 128-token prefill ms | offline tok/s | France |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in best.items():
        print(f"| {name} | {r['weights_gib']:.3f} | {r['decode_tok_s']:.1f} | {r['prefill_128_ms']:.1f} "
              f"| {r['offline_tok_s']:.1f} | {r['france'].strip()} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": results, "best": best}, f, indent=2)


if __name__ == "__main__":
    main()
