"""Where a profiled run's time went, from the Chrome traces the workers write (`--profile`,
`LLM.start_profile()`; shardserve/worker/profiler.py): the GPU's busy time against the span of its
kernels, the kernels and host ops with the most time, and the Python functions with the most time
of their own (the traces hold call stacks by default). A host-bound step shows a GPU mostly idle
across its span and the host's time in Python.

    python3 benchmarks/trace_summary.py TRACE.pt.trace.json.gz [--top 15]
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def totals(events: list[dict]) -> dict[str, float]:
    """Summed duration (us) per event name."""
    out: dict[str, float] = defaultdict(float)
    for e in events:
        out[e["name"]] += e.get("dur", 0.0)
    return out


def self_times(events: list[dict]) -> dict[str, float]:
    """Time (us) per Python function spent in the function itself, not in the Python functions it
    called: the nested events of each thread, with each child's time taken off its parent."""
    out: dict[str, float] = defaultdict(float)
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        by_thread[e.get("pid"), e.get("tid")].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        stack: list[tuple[dict, float]] = []   # (event, its end)
        for e in evs:
            end = e["ts"] + e.get("dur", 0.0)
            while stack and stack[-1][1] <= e["ts"]:
                stack.pop()
            out[e["name"]] += e.get("dur", 0.0)
            if stack:
                out[stack[-1][0]["name"]] -= e.get("dur", 0.0)
            stack.append((e, end))
    return out


def summarize(path: str, top: int = 15) -> dict:
    events = load_events(path)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    summary: dict = {"trace": path}
    if kernels:
        start = min(e["ts"] for e in kernels)
        end = max(e["ts"] + e["dur"] for e in kernels)
        summary["gpu_span_ms"] = (end - start) / 1000
        summary["gpu_busy_ms"] = sum(e["dur"] for e in kernels) / 1000
    for key, cat, measure in (("kernels", "kernel", totals), ("host_ops", "cpu_op", totals),
                              ("python_self", "python_function", self_times)):
        ranked = sorted(measure([e for e in events if e.get("cat") == cat]).items(), key=lambda kv: -kv[1])
        summary[key] = [(name, us / 1000) for name, us in ranked[:top]]
    return summary


def print_summary(s: dict) -> None:
    print(s["trace"])
    if "gpu_span_ms" in s:
        print(f"GPU: {s['gpu_busy_ms']:.3f} ms of kernels in a {s['gpu_span_ms']:.3f} ms span "
              f"({100 * s['gpu_busy_ms'] / max(s['gpu_span_ms'], 1e-9):.0f}% busy)")
    for key, title in (("kernels", "kernels, total"), ("host_ops", "host ops, total (nested ops count twice)"),
                       ("python_self", "Python functions, own time")):
        if s[key]:
            print(f"{title}:")
            for name, ms in s[key]:
                print(f"  {ms:9.3f} ms  {name[:100]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    for path in a.traces:
        print_summary(summarize(path, a.top))


if __name__ == "__main__":
    main()
