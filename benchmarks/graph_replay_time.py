"""Where a decode step's time goes on a GPU: one CUDA-graph replay of the model (device time alone)
against a whole engine step at the same batch (replay + input preparation + sampling + bookkeeping).

    python3 benchmarks/graph_replay_time.py --shape llama-3-8b --batch-size 1
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve import LLM, SamplingParams   # noqa: E402
from shardserve.bench.shapes import shape_config, write_shape_dir   # noqa: E402


def profile_replay(graphs, bs: int) -> None:
    """Kernel times of a replay whose requests each attend over 256 tokens (of the null block: a
    replay needs no real requests, and attention's cost depends on lengths, not contents)."""
    with torch.inference_mode():
        graphs.seq_lens[:bs].fill_(256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graphs.graphs[bs].replay()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / 10
    print(f"kernels per replay: {sum(e.count for e in events) // 10}, {total / 1000:.3f} ms of kernel time")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:15]:
        print(f"  {e.device_time_total / 10 / 1000:7.3f} ms  {e.count // 10:4d}x  {e.key[:90]}")
    with torch.inference_mode():
        graphs.seq_lens[:bs].fill_(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--profile", action="store_true", help="also print the kernels of one replay, 256 tokens of context")
    a = p.parse_args()
    llm = LLM(write_shape_dir(shape_config(a.shape), a.shape), load_format="dummy", skip_tokenizer_init=True,
              device="cuda", dtype="bfloat16", show_progress=False, async_scheduling=a.async_scheduling)
    graphs = llm.engine.executor.worker.model_runner.graphs
    bs = next(s for s in graphs.sizes if s >= a.batch_size)
    g = graphs.graphs[bs]
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        g.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - t) / 50 * 1000
    if a.profile:
        profile_replay(graphs, bs)
    prompts = [[7] * 128] * a.batch_size
    params = SamplingParams(temperature=0, max_tokens=257, ignore_eos=True, detokenize=False)
    llm.generate(prompts, SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    step_ms = (time.perf_counter() - t - prefill) / 256 * 1000
    print(f"batch {a.batch_size}, async scheduling {'on' if a.async_scheduling else 'off'}: graph replay {replay_ms:.2f} ms (device), engine decode step {step_ms:.2f} ms, "
          f"host work around the replay {step_ms - replay_ms:.2f} ms")


if __name__ == "__main__":
    main()
