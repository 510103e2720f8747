"""`bench throughput`'s workload run step by step: how long the steps take by the size of the running
batch, and torch.profiler traces of a few steps at chosen points (a whole profiled run is too slow
to trace; a window of steps in the steady decode phase shows where a step goes).

    SHARDSERVE_TORCH_PROFILER_DIR=/tmp/tr SHARDSERVE_TORCH_PROFILER_WITH_STACK=0 \\
    python3 benchmarks/throughput_steps.py --window 200:6 --window 700:6 [bench throughput flags]

Defaults to G2 (Llama-3-8B shape, random weights, nano-vllm's 256 requests of 100-1023 tokens in and
out); any `shardserve bench throughput` flag overrides. Each window finishes the steps in flight,
traces its steps, then prints benchmarks/trace_summary.py's summary of the trace. The figures
exclude the windows' time. Also printed: the slowest steps, and any Triton kernel variant compiled
after the warm-up (each stalls its step; the engine means to compile them all at start-up).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.trace_summary import print_summary, summarize  # noqa: E402
from shardserve import SamplingParams  # noqa: E402
from shardserve.bench.offline import make_llm, model_source, throughput_requests  # noqa: E402
from shardserve.cli import build_parser  # noqa: E402

G2 = ["--random-weights", "llama-3-8b", "--num-prompts", "256", "--input-len", "562", "--output-len", "562",
      "--random-range-ratio", "0.822"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", action="append", default=[], metavar="STEP:COUNT",
                    help="trace COUNT steps from step STEP (needs SHARDSERVE_TORCH_PROFILER_DIR)")
    ap.add_argument("--json", help="write the step times here")
    args, rest = ap.parse_known_args()
    windows = dict(tuple(int(v) for v in w.split(":")) for w in args.window)
    ns = build_parser().parse_args(["bench", "throughput", *G2, *rest])
    path, config, random_weights = model_source(ns)
    llm = make_llm(ns, path, random_weights)
    engine = llm.engine
    try:
        prompts, params = throughput_requests(ns, config["vocab_size"])
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)   # warm-up
        late: list[tuple[int, str, str]] = []   # (step, kernel, variant) of each compiled from here on
        _compile_hook(lambda name, key: late.append((n, name, key)))
        for prompt, p in zip(prompts, params):
            engine.add_request(engine.next_request_id(), prompt, p)
        steps, traces, traced_s, n = [], [], 0.0, 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            if n in windows:
                engine.finish_in_flight()
                t = time.perf_counter()
                engine.start_profile()
                for _ in range(windows[n]):
                    engine.step()
                    n += 1
                engine.finish_in_flight()
                traces += engine.stop_profile()
                traced_s += time.perf_counter() - t
                steps.append(None)   # no step time across a window
                continue
            running = len(engine.scheduler.running)
            t = time.perf_counter()
            engine.step()
            n += 1
            steps.append((t - start - traced_s, running))
        elapsed = time.perf_counter() - start - traced_s
    finally:
        engine.shutdown()
    n_out = sum(p.max_tokens for p in params)
    print(f"{n} steps in {elapsed:.2f} s without the traced windows: {n_out / elapsed:.0f} output tokens/s")
    by_batch: dict[int, list[float]] = {}
    for a, b in zip(steps, steps[1:]):   # with async scheduling a step's time is the gap to the next one
        if a is not None and b is not None:
            by_batch.setdefault(a[1] // 32 * 32, []).append(b[0] - a[0])
    for size, times in sorted(by_batch.items()):
        times.sort()
        median = 1e3 * times[len(times) // 2]
        print(f"  {size:3d}-{size + 31:3d} running: {len(times):4d} steps, median {median:6.2f} ms, "
              f"{sum(times):6.2f} s in all")
    timed = [(b[0] - a[0], i, a[1]) for i, (a, b) in enumerate(zip(steps, steps[1:]))
             if a is not None and b is not None]
    print("slowest steps: " + ", ".join(f"#{i} ({r} running) {1e3 * t:.1f} ms" for t, i, r in sorted(timed)[-8:][::-1]))
    print(f"Triton variants compiled after the warm-up: {len(late)}")
    for i, kernel, variant in late:
        print(f"  step {i}: {kernel} {variant}")
    for trace in traces:
        print_summary(summarize(trace, top=15))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"elapsed_s": elapsed, "output_tokens": n_out, "steps": steps, "traces": traces,
                       "late_compiles": late}, f)


def _compile_hook(record) -> None:
    """Calls record(kernel name, variant key) for each Triton kernel variant compiled from now on."""
    try:
        import triton
        triton.knobs.runtime.jit_cache_hook = lambda **kw: record(kw["fn"].name, str(kw["key"]))
    except (ImportError, AttributeError):   # no Triton, or one without the hook
        pass


if __name__ == "__main__":
    main()
