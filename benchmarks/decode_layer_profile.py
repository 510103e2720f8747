"""Where a decoder layer's time goes in a profiled decode, kernel by kernel, as it runs in the chain
(CUDA graphs and programmatic dependent launch included): from a Chrome trace the workers write
(`--profile`, shardserve/worker/profiler.py), the median duration of each kernel of a layer, the
median gap from the previous kernel's end to its start (negative: it was launched early and
waited), and their sum, the time the kernel really adds. Layers are found by the decode attention
kernel; the table lists the most common layer's kernels in order. Where no norm kernel comes
before the attention (tensor parallelism folds the norm into the all-reduce), a layer is counted
from one attention kernel to the next.

    SHARDSERVE_TORCH_PROFILER_DIR=D SHARDSERVE_TORCH_PROFILER_WITH_STACK=0 python -m shardserve bench latency \\
        --random-weights llama-3-8b [-q fp8] --batch-size 1 --input-len 128 --output-len 24 --num-iters 2 --profile
    python3 benchmarks/decode_layer_profile.py D/*.pt.trace.json.gz [--json OUT]
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import Counter

ANCHOR = "_paged_decode_kernel"   # decode attention: one per layer and step
NORM = "rms_norm_kernel"          # a layer starts with the norm before its qkv


def kernels(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])


def layers(ks: list[dict]) -> list[list[tuple[dict, dict]]]:
    """Each decode layer as its (kernel, kernel before it) pairs, from the norm before its attention
    to the kernel before the next layer's norm (without norm kernels: from attention to attention);
    only layers shaped like the most common one."""
    anchors = [i for i, k in enumerate(ks) if k["name"] == ANCHOR and i > 0]
    with_norm = [max((n for n in range(max(0, i - 8), i) if ks[n]["name"] == NORM), default=None) for i in anchors]
    starts = [j for j in with_norm if j] if any(with_norm) else anchors
    spans = [[(ks[n], ks[n - 1]) for n in range(a, b)] for a, b in zip(starts, starts[1:])]
    shape = Counter(tuple(k["name"] for k, _ in span) for span in spans).most_common(1)
    return [span for span in spans if shape and tuple(k["name"] for k, _ in span) == shape[0][0]]


def summary(path: str) -> dict:
    found = layers(kernels(path))
    if not found:
        raise SystemExit(f"{path}: no decode layers (no {ANCHOR} after a {NORM})")
    rows = []
    for pos in range(len(found[0])):
        dur = statistics.median(span[pos][0]["dur"] for span in found)
        gap = statistics.median(span[pos][0]["ts"] - span[pos][1]["ts"] - span[pos][1]["dur"] for span in found)
        rows.append({"kernel": found[0][pos][0]["name"], "dur_us": round(dur, 2), "gap_us": round(gap, 2),
                     "effective_us": round(dur + gap, 2)})
    return {"trace": path, "layers": len(found), "layer_us": round(sum(r["effective_us"] for r in rows), 2),
            "kernels": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--json", default=None, help="write the summaries here too")
    ns = p.parse_args()
    out = [summary(path) for path in ns.traces]
    for s in out:
        print(f"{s['trace']}: {s['layers']} layers, a layer {s['layer_us']} us (the kernels' additions)")
        print(f"  {'kernel':42s} {'dur':>8s} {'gap':>8s} {'adds':>8s}")
        for r in s["kernels"]:
            print(f"  {r['kernel'][:42]:42s} {r['dur_us']:8.2f} {r['gap_us']:8.2f} {r['effective_us']:8.2f}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
