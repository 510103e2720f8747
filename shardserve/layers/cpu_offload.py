"""--cpu-offload-gb: whole decoder layers whose weights live in pinned CPU memory and are streamed
to the GPU for each forward pass, so a model larger than the GPU still serves (vLLM's flag; its
`N GiB of each GPU's weights`, rounded up to whole layers).

How it runs:
- While the model is built, `maybe_offload(layer)` moves the parameters of each new decoder layer
  to the CPU until the budget is spent (the first layers of this rank's stage). The GPU never holds
  more than the resident weights plus one layer, so the model needs not fit.
- Checkpoint tensors load into those CPU parameters; quantization's after-loading step runs on the
  GPU one layer at a time (`finish_loading`), then the layer's parameters are packed into one pinned
  buffer and become views of one of two GPU slots: offloaded layer k uses slot k % 2.
- Forward: the first offloaded layer's pre-hook starts copying layers 0 and 1 on a side stream;
  each layer waits for its own copy, and when it is done the copy of layer k + 2 into its slot
  starts. So one layer computes while the next arrives: a step costs about max(compute, offloaded
  bytes / PCIe bandwidth).
Buffers (a layer's KV scales, the shared rotary table) stay on the GPU. Steps run eagerly (the
hooks are Python; the engine turns CUDA graphs off with offloading)."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

logger = logging.getLogger("shardserve")
_ALIGN = 256   # bytes: every parameter starts on a boundary the GPU kernels' vector loads like


@dataclass
class OffloadBudget:
    limit_bytes: int
    taken_bytes: int = 0
    layers: list[nn.Module] = field(default_factory=list)


_BUDGET: OffloadBudget | None = None


@contextmanager
def cpu_offload(limit_bytes: int) -> Iterator[OffloadBudget]:
    """Decoder layers built inside (through `maybe_offload`) go to the CPU until `limit_bytes` of
    weights have."""
    global _BUDGET
    old, _BUDGET = _BUDGET, OffloadBudget(limit_bytes)
    try:
        yield _BUDGET
    finally:
        _BUDGET = old


def maybe_offload(layer: nn.Module) -> nn.Module:
    budget = _BUDGET
    if budget is None or budget.taken_bytes >= budget.limit_bytes:
        return layer
    with torch.no_grad():
        for p in layer.parameters():
            p.data = p.data.to("cpu")
    budget.taken_bytes += sum(p.numel() * p.element_size() for p in layer.parameters())
    budget.layers.append(layer)
    return layer


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class OffloadedLayers:
    """The streaming of a model's offloaded layers (see the module docstring)."""

    def __init__(self, layers: list[nn.Module], device: torch.device) -> None:
        # No reference to the layers: their hooks hold this object, and a cycle would keep the
        # model's GPU memory alive until the garbage collector ran.
        self.count, self.device = len(layers), device
        self.host: list[torch.Tensor] = []   # one pinned byte buffer per layer
        layouts = [self._pack(layer) for layer in layers]
        slot_bytes = max(h.numel() for h in self.host)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(min(2, len(layers)))]
        for k, (layer, layout) in enumerate(zip(layers, layouts)):
            slot = self.slots[k % 2]
            for p, offset, nbytes in layout:
                p.data = slot[offset:offset + nbytes].view(p.dtype).view(p.shape)
            layer.register_forward_pre_hook(self._before(k))
            layer.register_forward_hook(self._after(k))
        self.stream = torch.cuda.Stream(device)
        self.loaded = [torch.cuda.Event() for _ in layers]

    @property
    def offloaded_bytes(self) -> int:
        return sum(h.numel() for h in self.host)

    @property
    def slot_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def _pack(self, layer: nn.Module) -> list[tuple[nn.Parameter, int, int]]:
        layout, offset = [], 0
        for p in layer.parameters():
            nbytes = p.numel() * p.element_size()
            layout.append((p, offset, nbytes))
            offset = _aligned(offset + nbytes)
        host = torch.empty(max(offset, 1), dtype=torch.uint8, pin_memory=True)
        for p, at, nbytes in layout:
            host[at:at + nbytes].copy_(p.data.detach().contiguous().reshape(-1).view(torch.uint8))
        self.host.append(host)
        return layout

    def _fetch(self, k: int) -> None:
        with torch.cuda.stream(self.stream):
            host = self.host[k]
            self.slots[k % 2][:host.numel()].copy_(host, non_blocking=True)
            self.loaded[k].record(self.stream)

    def _before(self, k: int) -> Callable:
        def hook(module: nn.Module, args) -> None:
            compute = torch.cuda.current_stream(self.device)
            if k == 0:   # a new forward pass: the slots are free once the work queued so far is done
                self.stream.wait_stream(compute)
                for first in range(min(2, self.count)):
                    self._fetch(first)
            compute.wait_event(self.loaded[k])
        return hook

    def _after(self, k: int) -> Callable:
        def hook(module: nn.Module, args, output) -> None:
            if k + 2 < self.count:   # slot k % 2 is free once this layer's kernels have run
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                self._fetch(k + 2)
        return hook


def finish_loading(budget: OffloadBudget, device: torch.device,
                   process: Callable[[nn.Module], None]) -> OffloadedLayers | None:
    """After the checkpoint is in: run `process` (quantization's after-loading step) on each
    offloaded layer on the GPU, one at a time, then set up the streaming."""
    if not budget.layers:
        return None
    with torch.no_grad():
        for layer in budget.layers:
            for p in layer.parameters():
                p.data = p.data.to(device)
            process(layer)
            for p in layer.parameters():
                p.data = p.data.to("cpu")
    offloaded = OffloadedLayers(budget.layers, device)
    logger.info("CPU offload: %d decoder layers (%.2f GiB of weights) in pinned CPU memory, streamed through "
                "%d GPU slots (%.2f GiB)", len(budget.layers), offloaded.offloaded_bytes / (1 << 30),
                len(offloaded.slots), offloaded.slot_bytes / (1 << 30))
    if len(budget.layers) <= 2:
        logger.warning("CPU offload: %d layer(s) offloaded take as much GPU memory in their slots as they free; "
                       "raise --cpu-offload-gb to free memory", len(budget.layers))
    return offloaded
