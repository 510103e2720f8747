"""Native CPU kernels for GGUF block-quantized weights (csrc/quant_ops.c): y = x @ W^T with W kept in
the file's blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), built and cached like cpu_ops.py's library.

One library holds a scalar, an AVX2 and an AVX-512 path; the best one the CPU runs is used, and
`SHARDSERVE_CPU_ISA=scalar|avx2|avx512` forces one (CI runs every path on any machine that has it;
asking for an ISA the CPU lacks is an error, never a silent fallback). Unlike cpu_ops, this library
needs no AVX2: on any x86-64 CPU with a C compiler the scalar path runs. `SHARDSERVE_CPU_KERNELS=0`
turns it off too (`available()` is then False and GGUF layers are dequantized at load).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil

import torch

from shardserve.kernels.cpu import cpu_ops

logger = logging.getLogger("shardserve")

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "quant_ops.c")
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
ISA_SWITCH = "SHARDSERVE_CPU_ISA"
ISAS = ("scalar", "avx2", "avx512")
# GGML type ids (gguf.GGMLQuantizationType) the kernels multiply.
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SHARDSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        logger.info("GGUF CPU kernels off (no C compiler found); GGUF weights are dequantized at load")
        return None
    try:
        lib = ctypes.CDLL(cpu_ops.build_library(compiler, _SOURCE, _FLAGS))
    except (OSError, RuntimeError) as e:
        logger.warning("GGUF CPU kernels off, build failed: %s", e)
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.gguf_linear.restype = lib.gguf_dequantize.restype = lib.gguf_cpu_isa.restype = c_int
    lib.gguf_linear.argtypes = [c_int, c_int, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64]
    lib.gguf_dequantize.argtypes = [c_int, ptr, i64, ptr, i64, i64]
    lib.gguf_block_info.restype = c_int
    lib.gguf_block_info.argtypes = [c_int, ctypes.POINTER(c_int)]
    return lib


def available() -> bool:
    return _library() is not None


def cpu_isas() -> tuple[str, ...]:
    """The paths this CPU runs, lowest first."""
    lib = _library()
    return ISAS[:lib.gguf_cpu_isa() + 1] if lib is not None else ()


@functools.cache
def _isa_from_env(value: str | None) -> int:
    runnable = cpu_isas()
    if not value:
        return len(runnable) - 1
    if value not in ISAS:
        raise ValueError(f"{ISA_SWITCH}={value!r}: use one of {', '.join(ISAS)}")
    if value not in runnable:
        raise ValueError(f"{ISA_SWITCH}={value}: this CPU runs only {', '.join(runnable)}")
    return ISAS.index(value)


def isa() -> str:
    """The path the kernels take now (SHARDSERVE_CPU_ISA, else the best this CPU runs)."""
    return ISAS[_isa_from_env(os.environ.get(ISA_SWITCH))]


def block_info(type_name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a type the kernels multiply."""
    nbytes = ctypes.c_int()
    values = _library().gguf_block_info(TYPES[type_name], ctypes.byref(nbytes))
    return values, nbytes.value


def linear(x: torch.Tensor, weight: torch.Tensor, type_name: str, bias: torch.Tensor | None = None,
           isa_name: str | None = None) -> torch.Tensor:
    """x ([..., K], widened to fp32) @ W^T (+ bias, fp32 [N]) -> fp32 [..., N]. weight: uint8, N rows
    of K / values-per-block blocks, contiguous ([N, blocks, bytes] or [N, row bytes])."""
    k = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.dtype != torch.float32 or x2.stride(-1) != 1:
        x2 = x2.to(torch.float32).contiguous()
    assert weight.dtype == torch.uint8 and weight.is_contiguous()
    n = weight.shape[0]
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    level = _isa_from_env(os.environ.get(ISA_SWITCH)) if isa_name is None else _isa_from_env(isa_name)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    rc = _library().gguf_linear(level, TYPES[type_name], x2.data_ptr(), x2.stride(0), weight.data_ptr(),
                                weight.numel() // max(n, 1), None if bias is None else bias.data_ptr(),
                                y.data_ptr(), n, x2.shape[0], n, k)
    if rc:
        raise ValueError(f"GGUF {type_name} weight of {tuple(weight.shape)} bytes does not hold {n} rows of {k} values")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def dequantize(weight: torch.Tensor, type_name: str, k: int) -> torch.Tensor:
    """The fp32 values [N, k] of a uint8 block weight, as the kernels expand them."""
    weight = weight.contiguous()
    n = weight.shape[0]
    out = torch.empty(n, k, dtype=torch.float32)
    if _library().gguf_dequantize(TYPES[type_name], weight.data_ptr(), weight.numel() // max(n, 1),
                                  out.data_ptr(), n, k):
        raise ValueError(f"GGUF {type_name} weight of {tuple(weight.shape)} bytes does not hold {n} rows of {k} values")
    return out
