"""Host-to-device copies that do not wait for the device."""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (list, numpy array or CPU tensor) on `device`, without waiting for the work queued
    there: staged through pinned memory and copied non-blocking. A plain copy to a GPU waits for its
    whole stream, which would serialise the next step's preparation behind the running one (async
    scheduling, docs/engine.md). On a CPU device the values are returned as a tensor, shared where
    they already are one (or a numpy array)."""
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
