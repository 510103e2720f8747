"""Milliseconds per call of a GPU function, by CUDA events, and where the figures-only GPU tests
put what they measured."""
from __future__ import annotations

import json
import os

import torch


def time_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def report(name: str, shape: dict, rows: list[dict]) -> None:
    """Print a figures-only test's rows, and write them with the device and shape to $OUT/name.json
    when $OUT is set (the device tool brings that folder back)."""
    print(json.dumps(rows))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), shape=shape, rows=rows), f, indent=1)
