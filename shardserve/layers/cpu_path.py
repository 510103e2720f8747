"""Which CPU path serves a model: the one place that decides, from the dtype, the CPU's features and
the switches, what dtype activations are computed in on a CPU, and so which kernels multiply them.

The paths (docs/engine.md has the measurements behind the defaults):
- **fp32 math on packed weights** (the default wherever the native kernels build: any x86 CPU with
  AVX2 + FMA and a C compiler). Weights keep their checkpoint values, bf16 or fp32, packed in
  panels that the native kernel widens in registers; activations are fp32; the KV cache holds the
  serving dtype. Decode reads the fewest bytes and every kernel is batch invariant.
- **native half precision** (`SHARDSERVE_CPU_NATIVE_HALF=1`, or the default without the native
  kernels on a CPU with bf16/fp16 matrix units): activations stay bf16/fp16 and torch's own GEMMs
  (oneDNN: AVX512-BF16, AMX) multiply them. Attention still runs in the native kernel (fp32 math on
  the bf16 pool) and the LM head gives fp32 logits, so near-ties are not decided by bf16 rounding.
- **plain torch** (`SHARDSERVE_CPU_KERNELS=0`, no compiler, not x86): fp32 storage and math for
  bf16 on CPUs without bf16 units, torch's kernels throughout.

Every decision can be forced by a switch, so CI runs each path whatever CPU it lands on.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

from shardserve.config import cpu_flags
from shardserve.kernels.cpu import cpu_ops

NATIVE_HALF_SWITCH = "SHARDSERVE_CPU_NATIVE_HALF"


@dataclass(frozen=True)
class CpuPath:
    compute_dtype: torch.dtype   # activations, and the dtype torch's own ops compute in
    native_kernels: bool         # the native kernels (kernels/cpu/csrc/cpu_ops.c) are built and used
    reason: str                  # why, for the start-up log line

    def describe(self, dtype: torch.dtype) -> str:
        name = _NAMES[dtype]
        if self.compute_dtype == torch.float32 and self.native_kernels:
            how = f"{name} weights packed for the native AVX2 kernels, fp32 math"
        elif self.compute_dtype == torch.float32:
            how = f"{name} values held and multiplied in fp32 by torch"
        elif self.native_kernels:
            how = f"native {name} math in torch (oneDNN), attention and LM head in the native kernels"
        else:
            how = f"native {name} math in torch (oneDNN)"
        return f"{how} ({self.reason})"


_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def has_half_units(dtype: torch.dtype) -> bool:
    """Whether the CPU multiplies `dtype` natively (x86 AVX512-BF16/AMX, AVX512-FP16; Arm always)."""
    flags = cpu_flags()
    native = {"avx512_bf16", "amx_bf16"} if dtype == torch.bfloat16 else {"avx512_fp16", "amx_fp16"}
    return bool(flags & native) or (not flags and platform.machine() in ("arm64", "aarch64"))


def choose_cpu_path(dtype: torch.dtype) -> CpuPath:
    kernels = cpu_ops.available()
    if dtype == torch.float32:
        return CpuPath(torch.float32, kernels, "fp32 requested")
    switch = os.environ.get(NATIVE_HALF_SWITCH)
    if switch in ("0", "1"):
        compute = dtype if switch == "1" else torch.float32
        return CpuPath(compute, kernels, f"forced by {NATIVE_HALF_SWITCH}={switch}")
    if switch:
        raise ValueError(f"{NATIVE_HALF_SWITCH}={switch!r}: use 1 (native half-precision math) or 0 (fp32 math)")
    if dtype == torch.bfloat16 and kernels:
        # Measured on an AVX512-BF16 CPU (BENCHMARKS.md): decode 2.5x faster than oneDNN's bf16 GEMMs.
        return CpuPath(torch.float32, True, f"the native kernels decode fastest; {NATIVE_HALF_SWITCH}=1 "
                                            "for torch's bf16 math")
    if has_half_units(dtype):
        return CpuPath(dtype, kernels, f"the CPU has {_NAMES[dtype]} units; {NATIVE_HALF_SWITCH}=0 for fp32 math")
    return CpuPath(torch.float32, kernels, f"the CPU has no {_NAMES[dtype]} units, torch's {_NAMES[dtype]} "
                                           f"GEMMs would be several times slower; {NATIVE_HALF_SWITCH}=1 forces them")
