"""GGUF K-quants on the CPU (issue 25): Q4_K / Q5_K / Q6_K linears kept in their blocks (integer dot
products, quant_dot.c) against the same file dequantized at load (bf16 panels), in one run.

    .venv/bin/python benchmarks/gguf_kquant_cpu.py [--rounds 2] [--files q4_k,q4_k_m,q6_k] [--threads 2]
        [--base DIR] [--json out.json]

No K-quant model ships with the repository and gguf-py cannot write K-quants, so the files are
random-weight Llama models written here (tests/models/gguf_files.py's plain K-quantizer, cached
under ~/.cache/shardserve/bench): hidden 1024, 16 layers, 16 heads (4 KV), FFN 2816, vocabulary
32000, untied. Files: `q4_k` (every linear and the embedding Q4_K, the LM head Q6_K), `q5_k`,
`q6_k` (all of that type) and `q4_k_m` (Q4_K with attn_v and ffn_down in Q6_K in every third
layer and the LM head Q6_K, as llama.cpp's Q4_K_M mixes them: those layers' fused q/k/v keep a
run of rows per type since session 18, see quantization/gguf.py).

Per contender, much as benchmarks/gguf_cpu.py measures: weights held, a fresh 128-token prompt's
prefill (the least of 3 times) and single-stream decode (127 over the least of 3 times of 128 new
tokens after a fresh 128-token prompt, less the least of 3 1-token requests), 2 threads,
`--dtype bfloat16`. Contenders alternate over `--rounds`,
each in a fresh process; the best round of each is reported. `--base DIR`: the blocks contenders
run from another checkout too (e.g. `git worktree add DIR HEAD~1`), alternating with this one's.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gguf_bench  # noqa: E402  (benchmarks/, the script's folder)

THREADS = "2"
SHAPE = dict(hidden=1024, layers=16, heads=16, kv_heads=4, ffn=2816, vocab=32000)
FILES = ("q4_k", "q4_k_m", "q5_k", "q6_k")
PATHS = {   # name: environment
    "blocks, x to ~16 bits (int16, default activations)": {"SHARDSERVE_GGUF_DEQUANTIZE": "0"},
    "blocks, x to 8 bits (int8)": {"SHARDSERVE_GGUF_DEQUANTIZE": "0", "SHARDSERVE_GGUF_ACTIVATIONS": "int8"},
    "dequantized at load (bf16 panels)": {"SHARDSERVE_GGUF_DEQUANTIZE": "1"},
}


def _tensor_type(kind: str, gname: str, layer: int) -> str:
    if gname == "output.weight":
        return "Q6_K" if kind in ("q4_k", "q4_k_m") else kind.upper()
    if kind == "q4_k_m":
        return "Q6_K" if layer % 3 == 0 and gname.endswith(("attn_v.weight", "ffn_down.weight")) else "Q4_K"
    return kind.upper()


def write_file(kind: str) -> str:
    """The random-weight model of `kind` (cached)."""
    from tests.models import gguf_files
    path = gguf_bench.cached_file(f"llama-{'-'.join(str(v) for v in SHAPE.values())}-{kind}.gguf")
    if os.path.exists(path):
        return path
    rng = np.random.default_rng(0)

    def blocks(rows: int, cols: int, qtype: str) -> np.ndarray:
        data = (rng.standard_normal((rows, cols), dtype=np.float32) * (1.0 / np.sqrt(cols))).astype(np.float32)
        return gguf_files.quantize(data, qtype)

    gguf_files.write_random_llama(path + ".tmp", SHAPE, lambda name, layer: _tensor_type(kind, name, layer), blocks)
    os.replace(path + ".tmp", path)
    return path


def measure(path: str, dtype: str, seed: int) -> dict:
    """Runs in the child process."""
    import torch

    from shardserve import LLM
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    t = time.perf_counter()
    llm = LLM(path, dtype=dtype, kv_cache_memory="1GiB", max_model_len=1024, show_progress=False, max_num_seqs=4)
    load_s = time.perf_counter() - t
    model = llm.engine.executor.worker.model_runner.model
    held = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:   # fresh tokens each time: no prefix-cache hit
        return [rng.randrange(300, SHAPE["vocab"]) for _ in range(n)]

    first, decode = gguf_bench.single_stream(llm, prompt, prefill_reps=3)
    return {"weights_gib": sum(held.values()) / (1 << 30), "load_s": load_s, "prefill_tok_s": 128 / first,
            "decode_tok_s": decode}


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(measure(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--files", default="q4_k,q4_k_m,q6_k", help=f"comma-separated, of {', '.join(FILES)}")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", default=THREADS, help="1 where another job holds a core: OpenMP's barriers "
                   "stall on a busy one")
    p.add_argument("--base", default=None, help="another checkout whose blocks contenders run too, as (base)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {name: (here, extra) for name, extra in PATHS.items()}
    if args.base:
        base = os.path.abspath(args.base)
        trees.update({f"{name} (base)": (base, extra) for name, extra in PATHS.items() if name.startswith("blocks")})
    from shardserve.kernels.cpu import quant_ops
    kinds = args.files.split(",")
    paths = {kind: write_file(kind) for kind in kinds}
    results: dict[str, dict[str, list[dict]]] = {kind: {name: [] for name in trees} for kind in kinds}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for kind in kinds:
            for name, (tree, extra) in trees.items():
                script = os.path.join(tree, "benchmarks", os.path.basename(__file__))
                results[kind][name].append(gguf_bench.run_child(script, [paths[kind], args.dtype, str(r)], args.threads,
                                                                {"PYTHONPATH": tree, **extra}))
    print(f"{args.dtype}, {args.threads} threads, ISA: {quant_ops.isa()}, best of {args.rounds} rounds; 1-minute load "
          f"average at each round's start: {', '.join(f'{x:.2f}' for x in loads)}")
    print("| file | contender | weights GiB | 128-token prefill tok/s | decode tok/s | decode vs dequantized |")
    print("| --- | --- | --- | --- | --- | --- |")
    best: dict[str, dict[str, dict]] = {}
    for kind in kinds:
        best[kind] = {name: rounds[0] | {key: max(x[key] for x in rounds) for key in ("prefill_tok_s", "decode_tok_s")}
                      for name, rounds in results[kind].items()}
        base = best[kind]["dequantized at load (bf16 panels)"]["decode_tok_s"]
        for name, x in best[kind].items():
            print(f"| {kind} | {name} | {x['weights_gib']:.3f} | {x['prefill_tok_s']:.0f} | {x['decode_tok_s']:.1f} "
                  f"| {x['decode_tok_s'] / base:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": SHAPE, "threads": args.threads, "base": args.base, "rounds": results, "best": best,
                       "load_average": loads}, f, indent=2)


if __name__ == "__main__":
    main()
