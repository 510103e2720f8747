"""benchmarks/decode_layer_profile.py on a hand-made trace of two steps of two layers: each kernel's
duration, the gap before it (negative where it was launched early and waited) and what it adds;
a layer cut by a step boundary is left out."""
from __future__ import annotations

import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import decode_layer_profile  # noqa: E402


def test_layers_and_their_kernels(tmp_path):
    events, t = [], 0.0
    layer = [("rms_norm_kernel", 2, 0), ("gemv_kernel", 10, -1), ("_paged_decode_kernel", 5, 0),
             ("_merge_splits_kernel", 6, -4), ("gemv_kernel", 12, -4), ("rms_norm_kernel", 2, 0),
             ("gemv_kernel", 40, -1), ("gemv_kernel", 20, 0)]
    for _step in range(2):
        events.append({"ph": "X", "cat": "kernel", "name": "embedding", "ts": t, "dur": 1})
        t += 1
        for _layer in range(2):
            for name, dur, gap in layer:
                t += gap
                events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur})
                t += dur
        events.append({"ph": "X", "cat": "kernel", "name": "lm_head", "ts": t + 1, "dur": 30})
        t += 31
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events + [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}, f)
    s = decode_layer_profile.summary(str(path))
    assert s["layers"] == 2   # of the three spans between layer starts, one holds the LM head and embedding
    assert [r["kernel"] for r in s["kernels"]] == [name for name, _, _ in layer]
    assert [(r["dur_us"], r["gap_us"], r["effective_us"]) for r in s["kernels"]][3:5] == [(6, -4, 2), (12, -4, 8)]
    assert s["layer_us"] == sum(dur + gap for _, dur, gap in layer[1:]) + 2
