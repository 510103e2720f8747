"""GGUF on the CPU (issue 25): the embedded SmolLM2-135M Q4_1 kept in its blocks, dequantized at load,
and llama.cpp on the same file, all in one run on this machine, 2 threads each.

    .venv/bin/python benchmarks/gguf_cpu.py [--rounds 3] [--dtype bfloat16] [--no-llama-cpp] [--json out.json]

Per contender: the weights held (our "Model loading took" figure), a fresh 128-token prompt's
prefill (tok/s, best of 2), single-stream decode (128 new tokens after a fresh 128-token prompt: the
time of that request less a 1-token request's on another fresh prompt of the same length; ignore_eos;
best of 3),
offline throughput (16 random 128-token prompts, 128 new tokens each, at once: generated tokens over
the whole job's time) and the greedy answer to the France question. llama.cpp
(benchmarks/llama_cpp_bench.py builds it): `llama-bench -t 2 -p 128 -n 128` (pp128, tg128) and
`llama-batched-bench` with the same 16 x (128 + 128) tokens. Each of ours runs in a fresh process; contenders
alternate over `--rounds` and the best round of each is reported, since neighbours on a shared
machine slow whoever runs beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import gguf_bench  # benchmarks/, the script's folder

THREADS = "2"
PATHS = {   # name: environment
    "blocks, x to ~16 bits (int16; the default)": {},
    "blocks, x to 8 bits (int8, llama.cpp's numerics)": {"SHARDSERVE_GGUF_ACTIVATIONS": "int8"},
    "blocks, AVX2 kernels (int16)": {"SHARDSERVE_CPU_ISA": "avx2"},
    "blocks, one kernel call at a time from Python (int16)": {"SHARDSERVE_CPU_DECODER_STACK": "0"},
    "dequantized at load (bf16 panels)": {"SHARDSERVE_GGUF_DEQUANTIZE": "1"},
}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def measure(dtype: str, seed: int) -> dict:
    """Runs in the child process."""
    import torch

    from shardserve import LLM, SamplingParams
    torch.set_num_threads(int(THREADS))
    llm = LLM(dtype=dtype, kv_cache_memory="2GiB", max_model_len=2048, show_progress=False, max_num_seqs=16)
    model = llm.engine.executor.worker.model_runner.model
    held = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:   # fresh tokens each time: no prefix-cache hit
        return [rng.randrange(100, 49000) for _ in range(n)]

    first, decode = gguf_bench.single_stream(llm, prompt, prefill_reps=2)
    batch = [prompt(128) for _ in range(16)]
    t = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    offline = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    answer = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    return {"weights_gib": sum(held.values()) / (1 << 30), "prefill_tok_s": 128 / first, "decode_tok_s": decode,
            "offline_tok_s": offline, "france": answer.strip()}


def llama_cpp() -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llama_cpp_bench
    result = llama_cpp_bench.run(int(THREADS), 128, 128, reps=3)
    result.update(llama_cpp_bench.run_batched(int(THREADS), 128, 128, 16))   # the same 16 x (128 + 128)
    return {"weights_gib": os.path.getsize(llama_cpp_bench.embedded_gguf()) / (1 << 30),
            "prefill_tok_s": result["pp_tok_s"], "decode_tok_s": result["tg_tok_s"],
            "offline_tok_s": result.get("batched_tok_s", float("nan")), "france": "(not asked)"}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(measure(sys.argv[2], int(sys.argv[3]))))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from shardserve.kernels.cpu import quant_ops
    paths = {name: env for name, env in PATHS.items()
             if env.get("SHARDSERVE_CPU_ISA") in (None, *quant_ops.cpu_isas())}
    names = list(paths) + ([] if args.no_llama_cpp else ["llama.cpp (llama-bench, llama-batched-bench)"])
    results: dict[str, list[dict]] = {name: [] for name in names}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name in names:
            if name not in paths:
                results[name].append(llama_cpp())
                continue
            results[name].append(gguf_bench.run_child(__file__, [args.dtype, str(r)], THREADS, paths[name]))
    best = {name: rounds[0] | {key: max(r[key] for r in rounds)
                               for key in ("prefill_tok_s", "decode_tok_s", "offline_tok_s")}
            for name, rounds in results.items()}
    print(f"{args.dtype}, {THREADS} threads, best ISA here: {quant_ops.isa()}, best of {args.rounds} rounds; "
          f"1-minute load average at each round's start: {', '.join(f'{x:.2f}' for x in loads)}")
    print("| contender | weights GiB | 128-token prefill tok/s | decode tok/s | offline tok/s | France |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in best.items():
        print(f"| {name} | {r['weights_gib']:.3f} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} "
              f"| {r['offline_tok_s']:.1f} | {r['france']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": results, "best": best, "load_average": loads}, f, indent=2)


if __name__ == "__main__":
    main()
