"""Tile settings for the quantized-weight kernels, per GPU: configs/device_name=<GPU>.json, written
by `benchmarks/quant_gemv.py --sweep --write-configs` from timings on that GPU. Keys are
"<kernel>:<N>,<K>,<gated>:<rows>" (the fastest settings measured for that weight shape and row
count); a shape or GPU not in the file gets the kernel's defaults. `benchmarks/skinny_matmul.py
--write-configs` adds the FP8 matmul's "mm_fp8" keys (kernels/matmul/triton_skinny.py) to the same
file. SHARDSERVE_QUANT_KERNELS=0 turns the quantized-weight kernels off (dequantize-then-matmul in
torch, `_scaled_mm` for FP8; A/B runs)."""
from __future__ import annotations

import functools
import json
import os

import torch

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
ENABLED = os.environ.get("SHARDSERVE_QUANT_KERNELS", "1") != "0"


def file_name(device_name: str) -> str:
    return f"device_name={device_name.replace(' ', '_')}.json"


@functools.cache
def _table(device_index: int) -> dict[str, list]:
    path = os.path.join(CONFIG_DIR, file_name(torch.cuda.get_device_name(device_index)))
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write(entries: dict[str, list], device_name: str) -> str:
    """Add (or replace) `entries` in this GPU's file, keeping its other keys; returns the path."""
    path = os.path.join(CONFIG_DIR, file_name(device_name))
    table = {}
    if os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    table.update(entries)
    os.makedirs(CONFIG_DIR, exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(sorted(table.items())), f, indent=1)
    return path


def key(kernel: str, n: int, k: int, gated: bool, rows: int) -> str:
    return f"{kernel}:{n},{k},{int(gated)}:{rows}"


def lookup(kernel: str, n: int, k: int, gated: bool, rows: int, device: torch.device) -> list | None:
    """The settings measured for the nearest row count at or above `rows` (none above: the defaults)."""
    return _lookup(kernel, n, k, gated, rows, device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _lookup(kernel: str, n: int, k: int, gated: bool, rows: int, device_index: int) -> list | None:
    table = _table(device_index)
    if not table:
        return None
    prefix = key(kernel, n, k, gated, 0)[:-1]
    counts = sorted(int(name[len(prefix):]) for name in table if name.startswith(prefix))
    if not counts:
        return None
    pick = next((c for c in counts if c >= rows), None)
    return None if pick is None else table[prefix + str(pick)]
