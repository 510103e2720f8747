"""How fast `bench throughput`'s workload (G2 by default) could run on a GPU of a given bandwidth and
matmul peak, step by step under the engine's own schedule (a token budget per step, running
requests first, then waiting ones in order; chunked prefills; no preemption, as the G2 pool holds
every request). Each step's bound is computed two ways:

- overlapped: max(its FLOPs at the peak, its weight and KV bytes at the bandwidth), the step's
  roofline if every kernel ran at both limits at once;
- one stream: max(FLOPs at the peak, weight bytes at the bandwidth) for the matmuls, then the KV
  bytes at the bandwidth for attention, as a step runs its kernels one after another.

Both assume every matmul at the measured peak and every byte at the measured copy bandwidth, so no
real run reaches either; `bench throughput` prints the schedule-free roofline below both.

    python3 benchmarks/throughput_bound.py --from-json RESULT.json [--max-num-batched-tokens 2048]
    python3 benchmarks/throughput_bound.py --bandwidth-gb-s 4270 --peak-tflops 790
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve.bench.offline import kv_bytes_per_token, throughput_requests  # noqa: E402
from shardserve.bench.shapes import SHAPES, active_layer_params, param_counts  # noqa: E402


def schedule(prompt_lens: list[int], output_lens: list[int], budget: int, max_seqs: int):
    """Yield each step as a list of (context before the step, tokens computed, emits a token)."""
    computed, emitted = [0] * len(prompt_lens), [0] * len(prompt_lens)
    waiting, running = deque(range(len(prompt_lens))), []
    while waiting or running:
        step, left = [], budget
        for r in running:   # running requests first: the next prefill chunk, or one decode token
            if left == 0:
                break
            n = min(prompt_lens[r] + emitted[r] - computed[r], left)
            step.append((r, n))
            left -= n
        while waiting and left > 0 and len(running) < max_seqs:
            r = waiting.popleft()
            running.append(r)
            n = min(prompt_lens[r], left)
            step.append((r, n))
            left -= n
        out = []
        for r, n in step:
            before = computed[r]
            computed[r] += n
            emits = computed[r] == prompt_lens[r] + emitted[r]   # the prompt done, or a decode
            emitted[r] += emits
            out.append((before, n, emits))
        running = [r for r in running if emitted[r] < output_lens[r]]
        yield out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--from-json", help="a `bench throughput --output-json` result: its bandwidth and peak")
    ap.add_argument("--bandwidth-gb-s", type=float)
    ap.add_argument("--peak-tflops", type=float)
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bytes per weight and KV element (bf16: 2)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=562)
    ap.add_argument("--output-len", type=int, default=562)
    ap.add_argument("--random-range-ratio", type=float, default=0.822)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ns = ap.parse_args()
    run = json.load(open(ns.from_json)) if ns.from_json else {}
    bandwidth = 1e9 * (ns.bandwidth_gb_s or run["bandwidth_gb_s"])
    peak = 1e12 * (ns.peak_tflops or run["peak_tflops"])
    config = SHAPES[ns.shape]
    counts = param_counts(config)
    layers, head = active_layer_params(counts), counts["lm_head"] or counts["embed"]
    weights, kv_token = counts["total"] * ns.dtype_bytes, kv_bytes_per_token(config, ns.dtype_bytes)
    prompts, params = throughput_requests(ns, config["vocab_size"])
    prompt_lens, output_lens = [len(p) for p in prompts], [p.max_tokens for p in params]
    steps = overlapped = one_stream = flops = 0.0
    for step in schedule(prompt_lens, output_lens, ns.max_num_batched_tokens, ns.max_num_seqs):
        f = sum(2.0 * layers * n + 2.0 * head * emits for _, n, emits in step)
        kv = kv_token * sum(before + n for before, n, _ in step)   # each request's keys read once
        overlapped += max(f / peak, (weights + kv) / bandwidth)
        one_stream += max(f / peak, weights / bandwidth) + kv / bandwidth
        flops, steps = flops + f, steps + 1
    print(f"{ns.shape}, {ns.num_prompts} requests, budget {ns.max_num_batched_tokens} tokens a step: "
          f"{int(steps)} steps at {bandwidth / 1e9:.0f} GB/s and {peak / 1e12:.0f} TFLOP/s")
    for name, seconds in (("overlapped", overlapped), ("one stream", one_stream)):
        print(f"  {name:10s}: {seconds:6.2f} s, MFU {100 * flops / seconds / peak:.1f}%"
              + (f"; the run took {run['elapsed_time'] / seconds:.2f}x" if run else ""))


if __name__ == "__main__":
    main()
