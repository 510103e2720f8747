"""Programmatic dependent launch (PDL, Hopper and newer) for the decode path's Triton kernels.

A decode step is hundreds of small dependent kernels; between two of them the GPU normally drains
the first before it starts launching the second. Launched with PDL, a kernel's programs can be
scheduled while the previous kernel is still running: each of our kernels first lets the next one
launch (`gdc_launch_dependents`), then waits until the previous one has finished and its writes
are visible (`gdc_wait`), and only then reads or writes memory. So every kernel still sees its
inputs complete, while the launch of the next overlaps the tail of the current. Measured on an H200
with 8B TP=2 shapes (7 kernels x 32 layers in a CUDA graph): 2.36 -> 2.17 ms. CUDA graphs keep the
programmatic edges. The kernels take `PDL` as a constexpr and begin with `pdl.start(PDL)`.

Late release (`launch_args(t, late=True)`, PDL 2): the kernel lets the next one launch only where it
calls `pdl.release(PDL)`, after its main loop, not at its start. Launched at the start, the next
kernels' programs (and theirs in turn: each lets its own successor launch at once) are placed on
the SMs while a weight-streaming GEMV still runs, and sit there waiting, holding registers and
shared memory. The quantized decode GEMVs (kernels/quant/) release late: measured on an H100, 8B
FP8 batch-1 decode step 4.12 -> 3.56 ms, INT4 2.96 -> 2.87 ms.

SHARDSERVE_PDL=0 launches them the ordinary way (for A/B runs).
"""
from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("SHARDSERVE_PDL", "1") != "0"

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    @triton.jit
    def start(PDL: tl.constexpr):
        """A kernel's first step: with PDL, let the next kernel launch, then wait until the previous
        one has finished and its writes are visible (only then may the kernel touch memory)."""
        if PDL:
            if PDL != 2:
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def release(PDL: tl.constexpr):
        """With PDL 2 (launch_args(late=True)): let the next kernel launch only here, once this
        program's loads are done, instead of at its start."""
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` launch with PDL (a CUDA device of compute capability 9+)."""
    return ENABLED and t.is_cuda and _capable(t.device.index if t.device.index is not None
                                              else torch.cuda.current_device())


def launch_args(t: torch.Tensor, late: bool = False) -> dict[str, bool | int]:
    """The kernel's PDL constexpr and Triton's launch option, for a kernel working on `t` (late: the
    kernel calls `release` where the next one may launch)."""
    on = enabled(t)
    return {"PDL": 2 if on and late else on, "launch_pdl": on}
