"""Host-to-device copies that do not wait for the device."""
from __future__ import annotations

import torch

_copy_streams: dict[tuple[int, str], torch.cuda.Stream] = {}


def copy_stream(device: torch.device, direction: str) -> torch.cuda.Stream:
    """A side stream per GPU and direction for the copies between steps: "in" (this module's) and
    "out" (the model runner's copy of the sampled tokens to the host, which waits for the step: the
    next step's inputs must not queue behind it)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), direction)
    if key not in _copy_streams:
        _copy_streams[key] = torch.cuda.Stream(key[0])
    return _copy_streams[key]


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (list, numpy array or CPU tensor) on `device`, without waiting for the work queued
    there: staged through pinned memory and copied non-blocking. A plain copy to a GPU waits for its
    whole stream, which would serialise the next step's preparation behind the running one (async
    scheduling, docs/engine.md). The copy runs on a side stream, at once, beside the step still
    running, and the current stream only waits for it: between two decode steps the chain of work
    has no copy in it (each costs a batch-1 step several us). The tensor comes from the side
    stream's memory and is marked as used by the current stream, so neither reuses it early. On a
    CPU device the values are returned as a tensor, shared where they already are one (or a numpy
    array)."""
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    pinned = t.pin_memory()
    current = torch.cuda.current_stream(device)
    if torch.cuda.is_current_stream_capturing():
        return pinned.to(device, non_blocking=True)
    side = copy_stream(device, "in")
    with torch.cuda.stream(side):
        out = pinned.to(device, non_blocking=True)
    current.wait_stream(side)
    out.record_stream(current)
    return out
