"""Every CPU path side by side on this machine, in one run (docs/engine.md, "CPU paths"): the embedded
SmolLM2-135M served by each path forced by its switch, each in a fresh process.

    .venv/bin/python benchmarks/cpu_paths.py [--rounds 2] [--json out.json]

Per path: single-stream decode (a 128-token random prompt, 128 new tokens, ignore_eos; the tok/s
of the decode steps after the first token), offline throughput (32 random prompts of 64-256
tokens, 128 new tokens each), and the greedy answer to the France question. Paths alternate over
`--rounds` rounds so a busy neighbour slows all of them alike; the best round is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PATHS = {   # name: (dtype, environment)
    "bf16, fp32 math in the native kernels": ("bfloat16", {"SHARDSERVE_CPU_NATIVE_HALF": "0"}),
    "bf16, native bf16 math (torch/oneDNN)": ("bfloat16", {"SHARDSERVE_CPU_NATIVE_HALF": "1"}),
    "fp32, native kernels": ("float32", {}),
    "bf16, plain torch, fp32 math": ("bfloat16", {"SHARDSERVE_CPU_KERNELS": "0", "SHARDSERVE_CPU_NATIVE_HALF": "0"}),
    "bf16, plain torch, bf16 math": ("bfloat16", {"SHARDSERVE_CPU_KERNELS": "0", "SHARDSERVE_CPU_NATIVE_HALF": "1"}),
    "fp32, plain torch": ("float32", {"SHARDSERVE_CPU_KERNELS": "0"}),
}


def measure(dtype: str, num_prompts: int = 32) -> dict:
    """Runs in the child process (benchmarks/gguf_cpu.py's too)."""
    import random

    from shardserve import LLM, SamplingParams
    llm = LLM(dtype=dtype, kv_cache_memory="2GiB", max_model_len=2048, show_progress=False, max_num_seqs=num_prompts)
    model = llm.engine.executor.worker.model_runner.model
    held = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49000) for _ in range(128)]
    batch = [[rng.randrange(100, 49000) for _ in range(rng.randint(64, 256))] for _ in range(num_prompts)]
    llm.generate([prompt[:16]], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    decode_tok_s = 127 / (time.perf_counter() - t - first)
    t = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    offline = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    return {"weights_gib": sum(held.values()) / (1 << 30), "decode_tok_s": decode_tok_s,
            "prefill_128_ms": first * 1e3, "offline_tok_s": offline, "france": answer}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(measure(sys.argv[2])))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    results: dict[str, list[dict]] = {name: [] for name in PATHS}
    for _ in range(args.rounds):
        for name, (dtype, env) in PATHS.items():
            # The GGUF dequantized at load, so every path multiplies bf16/fp32 weights (the block
            # kernels, the default for GGUF since issue 25 session 16, are benchmarks/gguf_cpu.py's).
            env = {"SHARDSERVE_GGUF_DEQUANTIZE": "1", **os.environ, **env}
            out = subprocess.run([sys.executable, __file__, "--child", dtype], env=env,
                                 capture_output=True, text=True, check=True).stdout
            results[name].append(json.loads(out.split("RESULT ", 1)[1]))
    best = {name: max(rounds, key=lambda r: r["decode_tok_s"]) | {
        "offline_tok_s": max(r["offline_tok_s"] for r in rounds),
        "prefill_128_ms": min(r["prefill_128_ms"] for r in rounds)} for name, rounds in results.items()}
    print(f"CPU flags: {' '.join(isa)}; {os.cpu_count()} cores")
    print("| path | decode tok/s | 128-token prefill ms | offline tok/s | France |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in best.items():
        print(f"| {name} | {r['decode_tok_s']:.1f} | {r['prefill_128_ms']:.1f} | {r['offline_tok_s']:.1f} "
              f"| {r['france'].strip()} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu_flags": isa, "rounds": results, "best": best}, f, indent=2)


if __name__ == "__main__":
    main()
