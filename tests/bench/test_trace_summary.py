"""benchmarks/trace_summary.py on a small hand-made trace: GPU busy time against the kernels' span,
totals per kernel, and each Python function's own time (its nested calls' time taken off)."""
from __future__ import annotations

import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import trace_summary  # noqa: E402


def _write(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_summary_of_a_small_trace(tmp_path, capsys):
    py = dict(ph="X", cat="python_function", pid=1, tid=1)
    events = [
        {**py, "name": "step", "ts": 0, "dur": 100},
        {**py, "name": "forward", "ts": 10, "dur": 60},
        {**py, "name": "launch", "ts": 20, "dur": 15},
        {**py, "name": "launch", "ts": 40, "dur": 15},
        {**py, "name": "sample", "ts": 75, "dur": 20},
        {**py, "name": "other thread", "ts": 0, "dur": 50, "tid": 2},
        {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 30, "dur": 4, "pid": 0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 50, "dur": 4, "pid": 0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "argmax", "ts": 80, "dur": 2, "pid": 0, "tid": 7},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 21, "dur": 5, "pid": 1, "tid": 1},
        {"ph": "i", "name": "an instant event, skipped", "ts": 5},
    ]
    path = str(tmp_path / "rank0.pt.trace.json.gz")
    _write(path, events)
    s = trace_summary.summarize(path)
    assert abs(s["gpu_span_ms"] - 0.052) < 1e-9 and abs(s["gpu_busy_ms"] - 0.010) < 1e-9
    assert s["kernels"][0] == ("gemv", 0.008)
    own = dict(s["python_self"])
    # step 100 - forward 60 - sample 20; forward 60 - two launches of 15
    assert own == {"step": 0.02, "forward": 0.03, "launch": 0.03, "sample": 0.02, "other thread": 0.05}
    trace_summary.print_summary(s)
    out = capsys.readouterr().out
    assert "0.010 ms of kernels in a 0.052 ms span (19% busy)" in out and "Python functions, own time" in out
