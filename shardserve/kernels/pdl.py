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

Weights ahead into L2 (`prefetch_rows`, the decode GEMVs): a GEMV launched with PDL is resident
before its input exists (behind a norm, or behind the attention kernels before o_proj), and its
weight does not depend on that input. So before it waits, each program asks the L2 for the start of
its weight rows (`cp.async.bulk.prefetch.L2`, Hopper), and the DRAM, idle under those
latency-bound kernels, streams them while the GEMV waits; the GEMV then reads them from L2. The
budget per matmul, SHARDSERVE_GEMV_PREFETCH_MB (default 16; 0 turns it off), caps what one
matmul asks for, so a large layer's prefetch cannot push its own lines out of the 50 MB L2
before they are read.

SHARDSERVE_PDL=0 launches them the ordinary way (for A/B runs).
"""
from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("SHARDSERVE_PDL", "1") != "0"
PREFETCH_BYTES = int(float(os.environ.get("SHARDSERVE_GEMV_PREFETCH_MB", "16")) * 2 ** 20)
PREFETCH_LINES = os.environ.get("SHARDSERVE_GEMV_PREFETCH", "lines") == "lines"


try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    # One thread per weight row: [base + row * stride, + bytes), inward to 16-byte bounds (the bulk
    # prefetch's alignment), asked of the L2 if anything is left; only the first warp's threads.
    _PREFETCH_ASM = tl.constexpr("""{
 .reg .pred p;
 .reg .u32 t, z;
 .reg .u64 a, e, o;
 mov.u32 t, %tid.x;
 setp.lt.u32 p, t, 32;
 setp.lt.and.s32 p, t, $3, p;
 cvt.u64.u32 o, t;
 mad.lo.u64 a, o, $2, $1;
 add.u64 e, a, $4;
 add.u64 a, a, 15;
 and.b64 a, a, -16;
 and.b64 e, e, -16;
 setp.gt.and.u64 p, e, a, p;
 sub.u64 o, e, a;
 cvt.u32.u64 z, o;
 @p cp.async.bulk.prefetch.L2.global [a], z;
 mov.u32 $0, 0;
}""")

    _LINE_ASM = tl.constexpr("""{
 .reg .pred p;
 setp.ne.s32 p, $2, 0;
 @p prefetch.global.L2 [$1];
 mov.u32 $0, 0;
}""")

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

    @triton.jit
    def prefetch_rows(PDL: tl.constexpr, row_ptr, stride, rows, nbytes, BLOCK: tl.constexpr,
                      LINES: tl.constexpr = PREFETCH_LINES):
        """With PDL (a kernel that then waits in `start`): ask the L2 for `nbytes` bytes from row_ptr
        of each of `rows` rows (at most BLOCK) `stride` bytes apart (the module docstring)."""
        if PDL and LINES:
            base = row_ptr.to(tl.int64)
            per_row = tl.cdiv(nbytes, 128)
            total = tl.minimum(rows, BLOCK) * per_row
            for first in range(0, total, 128):
                i = first + tl.arange(0, 128)
                addr = base + (i // per_row).to(tl.int64) * stride + (i % per_row) * 128
                tl.inline_asm_elementwise(_LINE_ASM, "=r,l,r", [addr, (i < total).to(tl.int32)], dtype=tl.int32,
                                          is_pure=False, pack=1)
        elif PDL:
            base = row_ptr.to(tl.int64)
            for i in tl.static_range(0, BLOCK, 32):
                tl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,l,r,l", [base + i * stride, stride.to(tl.int64),
                                          rows - i, nbytes.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` launch with PDL (a CUDA device of compute capability 9+)."""
    return ENABLED and t.is_cuda and _capable(t.device.index if t.device.index is not None
                                              else torch.cuda.current_device())


def prefetch_bytes(t: torch.Tensor, rows: int, row_bytes: int) -> int:
    """Bytes of each of `rows` weight rows (of `row_bytes`) a GEMV working on `t` asks the L2 for
    ahead: all of them within the budget, else an equal share of it per row (0: none)."""
    if not enabled(t) or PREFETCH_BYTES <= 0:
        return 0
    if os.environ.get("SHARDSERVE_GEMV_PREFETCH_FIT") == "1":
        return row_bytes // 128 * 128 if rows * row_bytes <= PREFETCH_BYTES else 0
    return min(row_bytes, PREFETCH_BYTES // max(rows, 1)) // 128 * 128


def launch_args(t: torch.Tensor, late: bool = False) -> dict[str, bool | int]:
    """The kernel's PDL constexpr and Triton's launch option, for a kernel working on `t` (late: the
    kernel calls `release` where the next one may launch)."""
    on = enabled(t)
    return {"PDL": 2 if on and late else on, "launch_pdl": on}
