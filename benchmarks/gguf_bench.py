"""What the CPU GGUF benchmarks (gguf_cpu.py, gguf_kquant_cpu.py, gguf_moe_cpu.py) share: where their
random-weight files are cached, each contender's fresh child process, and the single-stream measure
llama-bench's is matched against."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def cached_file(name: str) -> str:
    """~/.cache/shardserve/bench/<name> (XDG_CACHE_HOME honoured), its folder made."""
    root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardserve", "bench")
    os.makedirs(root, exist_ok=True)
    return os.path.join(root, name)


def single_stream(llm, prompt, prefill_reps: int) -> tuple[float, float]:
    """(seconds to a fresh 128-token prompt's first token, decode tok/s after such a prompt), each the
    best of its repetitions (a neighbour's burst on these shared machines only ever adds time):
    decode is 127 tokens over the least time for 128 new tokens less the first token's, as
    llama-bench's 3 repetitions after a warm-up. prompt(n): n fresh token ids (no prefix-cache hit)."""
    from shardserve import SamplingParams

    def timed(ids: list[int], n: int) -> float:
        t = time.perf_counter()
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    timed(prompt(16), 4)   # warm-up
    first = min(timed(prompt(128), 1) for _ in range(prefill_reps))
    return first, 127 / (min(timed(prompt(128), 128) for _ in range(3)) - first)


def run_child(script: str, args: list[str], threads: str, extra_env: dict[str, str]) -> dict:
    """`script --child *args` in a fresh process with the SHARDSERVE_GGUF* / SHARDSERVE_CPU_* switches
    of this one cleared, OMP_NUM_THREADS=threads and extra_env set; its `RESULT {json}` line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDSERVE_GGUF", "SHARDSERVE_CPU_"))}
    env = {**env, "OMP_NUM_THREADS": threads, **extra_env}
    out = subprocess.run([sys.executable, script, "--child", *args], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.split("RESULT ", 1)[1])
