"""Native CPU kernels for GGUF block-quantized weights (csrc/quant_ops.c, csrc/quant_dot.c): y = x @ W^T
with W kept in the file's blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), built and cached like
cpu_ops.py's library.

Two kinds of kernels: by default every type quantizes x to int8 blocks of 32 once per call and takes
integer dot products (quant_dot.c, llama.cpp's approach; a K-quant's 256-value super-block spans 8
blocks of x); with `SHARDSERVE_GGUF_ACTIVATIONS=fp32` the blocks are expanded and multiply fp32
activations (quant_ops.c, exact up to fp32 rounding).

One library holds a scalar, an AVX2, an AVX-512 and an AVX-512 VNNI path; the best one the CPU runs
is used, and `SHARDSERVE_CPU_ISA=scalar|avx2|avx512|avx512_vnni` forces one (CI runs every path on
any machine that has it; asking for an ISA the CPU lacks is an error, never a silent fallback).
Unlike cpu_ops, this library needs no AVX2: on any x86-64 CPU with a C compiler the scalar path runs.
`SHARDSERVE_CPU_KERNELS=0` turns it off too (`available()` is then False and GGUF layers are
dequantized at load).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
from typing import Callable

import torch

from shardserve.kernels.cpu import cpu_ops, decoder_stack

logger = logging.getLogger("shardserve")

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCE, _DOT_SOURCE = os.path.join(_CSRC, "quant_ops.c"), os.path.join(_CSRC, "quant_dot.c")
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
ISA_SWITCH = "SHARDSERVE_CPU_ISA"
ISAS = ("scalar", "avx2", "avx512", "avx512_vnni")   # each level implies the ones before it
ACTIVATIONS_SWITCH = "SHARDSERVE_GGUF_ACTIVATIONS"   # int16 | int8 | fp32, see activations()
# GGML type ids (gguf.GGMLQuantizationType) the kernels multiply.
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# Multiplied with int8 activations unless the switch says fp32 (all of them, K-quants included).
INT8_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# One block of a group of 8 rows as repack writes it: the file's 8 blocks (Q4_K / Q5_K: the 12 bytes
# of 6-bit scales and mins per row unpacked to 16 bytes, csrc/quant_dot.c).
_GROUP_BYTES = {"Q4_0": 8 * 18, "Q4_1": 8 * 20, "Q8_0": 8 * 34, "Q4_K": 1184, "Q5_K": 1440, "Q6_K": 8 * 210}


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SHARDSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        logger.info("GGUF CPU kernels off (no C compiler found); GGUF weights are dequantized at load")
        return None
    try:
        lib = ctypes.CDLL(cpu_ops.build_library(compiler, _SOURCE, _FLAGS, (_DOT_SOURCE,)))
    except (OSError, RuntimeError) as e:
        logger.warning("GGUF CPU kernels off, build failed: %s", e)
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.gguf_linear.restype = lib.gguf_dequantize.restype = lib.gguf_cpu_isa.restype = c_int
    lib.gguf_linear.argtypes = [c_int, c_int, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64]
    lib.gguf_linear_q8.restype = lib.gguf_repack8.restype = c_int
    lib.gguf_linear_q8.argtypes = [c_int, c_int, c_int, c_int, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.gguf_repack8.argtypes = [c_int, ptr, i64, i64, ptr]
    lib.gguf_moe_q8.restype = c_int
    lib.gguf_moe_q8.argtypes = [c_int, c_int, c_int, c_int, ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, ptr, i64, ptr]
    lib.gguf_rows8.restype = c_int
    lib.gguf_rows8.argtypes = [c_int, ptr, i64, ptr, i64, ptr]
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


ACTIVATIONS = {"int16": 2, "int8": 1, "fp32": 0}   # name: int8 levels x is quantized to (0: not quantized)


def activations() -> str:
    """How Q4_0/Q4_1/Q8_0 layers multiply (SHARDSERVE_GGUF_ACTIVATIONS): "int16" (the default: x
    quantized per block of 32 to two int8 levels, ~16 bits, integer dot products), "int8" (one level:
    llama.cpp's numerics, fewer multiplies) or "fp32" (blocks expanded, fp32 activations: exact)."""
    value = os.environ.get(ACTIVATIONS_SWITCH, "int16")
    if value not in ACTIVATIONS:
        raise ValueError(f"{ACTIVATIONS_SWITCH}={value!r}: use int16 (two int8 levels), int8 (one) or fp32 (exact)")
    return value


def block_info(type_name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a type the kernels multiply."""
    nbytes = ctypes.c_int()
    values = _library().gguf_block_info(TYPES[type_name], ctypes.byref(nbytes))
    return values, nbytes.value


def _prepare(x: torch.Tensor, bias: torch.Tensor | None, isa_name: str | None):
    k = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.dtype != torch.float32 or x2.stride(-1) != 1:
        x2 = x2.to(torch.float32).contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    level = _isa_from_env(isa_name or os.environ.get(ISA_SWITCH))
    return x2, bias, level


def repack(weight: torch.Tensor, type_name: str, k: int) -> torch.Tensor:
    """A weight's file rows (uint8 [N, row bytes]) regrouped for linear_int8: groups of 8 rows (N padded
    with zero rows), block after block (csrc/quant_dot.c); the same bytes per block, but for Q4_K /
    Q5_K's scales and mins, unpacked from 6 bits to bytes. Returns uint8 [ceil(N / 8), blocks, group
    block bytes] (blocks of 32 values, or 256 for the K-quants)."""
    values, nbytes = block_info(type_name)
    weight = weight.contiguous()
    n = weight.shape[0]
    if type_name not in INT8_TYPES or k % values or weight.numel() != n * (k // values) * nbytes:
        raise ValueError(f"GGUF {type_name} weight of {tuple(weight.shape)} bytes cannot be regrouped for {k} inputs")
    out = torch.empty((n + 7) // 8, k // values, _GROUP_BYTES[type_name], dtype=torch.uint8)
    _library().gguf_repack8(TYPES[type_name], weight.data_ptr(), n, k, out.data_ptr())
    return out


def rows(packed: torch.Tensor, type_name: str, k: int, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Rows `ids` (any shape) of an n-row weight regrouped by repack, expanded to fp32 [*ids.shape, k]
    with dequantize's values: an embedding lookup on the blocks."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"row ids must lie in [0, {n}), got {int(flat.min())}..{int(flat.max())}")
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    if _library().gguf_rows8(TYPES[type_name], packed.data_ptr(), k, flat.data_ptr(), flat.numel(), out.data_ptr()):
        raise ValueError(f"GGUF {type_name} rows cannot be looked up with int8-kernel layouts")
    return out.view(*ids.shape, k)


def linear_int8(x: torch.Tensor, packed: torch.Tensor, type_name: str, n: int, bias: torch.Tensor | None = None,
                isa_name: str | None = None, act: str | None = None, gated: bool = False) -> torch.Tensor:
    """x ([..., K], widened to fp32) @ W^T (+ bias, fp32 [N]) -> fp32 [..., n], W regrouped by repack:
    x quantized to int8 blocks of 32, one level (act "int8") or two ("int16"; default: activations()),
    integer dot products (csrc/quant_dot.c). gated: W is a merged [gate; up] pair (n / 2 rows each, a
    multiple of 8; no bias) and the result silu(x gate^T) * (x up^T), [..., n / 2]."""
    # Called ~120 times per decode step: the checks stay cheap (no environment reads when the
    # caller passes isa_name and act, as quantization/gguf.py does with what it resolved at load).
    levels = ACTIVATIONS[act or activations()]
    if not levels:
        raise ValueError("linear_int8 quantizes x: act must be int16 or int8")
    k = x.shape[-1]
    x2, bias, level = _prepare(x, bias, isa_name)
    unit = 256 if type_name.endswith("_K") else 32
    if (packed.dtype != torch.uint8 or not packed.is_contiguous() or type_name not in INT8_TYPES or k % unit
            or packed.shape[0] != (n + 7) // 8
            or packed.numel() != packed.shape[0] * (k // unit) * _GROUP_BYTES[type_name]):
        raise ValueError(f"GGUF {type_name} regrouped weight of {tuple(packed.shape)} {packed.dtype} does not hold {n} "
                         f"rows of {k} values")
    if gated and (n % 16 or bias is not None):
        raise ValueError(f"a gated GGUF matmul needs gate and up parts of whole 8-row groups and no bias, got {n} rows")
    out = n // 2 if gated else n
    y = torch.empty(x2.shape[0], out, dtype=torch.float32)
    if _library().gguf_linear_q8(level, TYPES[type_name], levels, int(gated), x2.data_ptr(), x2.stride(0),
                                 packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), out,
                                 x2.shape[0], n, k):
        raise MemoryError(f"GGUF {type_name} linear: no memory for {x2.shape[0]} x {k} int8 activations")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], out)


def moe_int8(x: torch.Tensor, w13: torch.Tensor, type13: str, w2: torch.Tensor, type2: str, inter: int,
             topk_ids: torch.Tensor, topk_weights: torch.Tensor, isa_name: str, act: str) -> torch.Tensor:
    """A MoE layer's picked experts in one kernel call (csrc/quant_dot.c's gguf_moe_q8): x [T, H] (fp32)
    -> fp32 [T, H], the sum over each token's picks of weight * down(silu(gate) * up). w13 [E, ...]
    each expert's [gate; up] (2 * inter rows of H) and w2 [E, ...] its down (H rows of inter), as
    repack regroups them; topk_ids [T, k] local expert ids (-1: held elsewhere), topk_weights [T, k].
    The same bits as one linear_int8 call per expert (gated, then plain) summed in expert order."""
    x = x.to(torch.float32).contiguous()
    t, h = x.shape
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    assert w13.dtype == w2.dtype == torch.uint8 and w13.is_contiguous() and w2.is_contiguous()
    y = torch.empty(t, h, dtype=torch.float32)
    rc = _library().gguf_moe_q8(_isa_from_env(isa_name), TYPES[type13], TYPES[type2], ACTIVATIONS[act], x.data_ptr(),
                                t, h, inter, ids.data_ptr(), weights.data_ptr(), ids.shape[1], w13.data_ptr(),
                                w13[0].numel(), w2.data_ptr(), w2[0].numel(), y.data_ptr())
    if rc == -2:
        raise MemoryError(f"GGUF experts: no memory for {t} tokens' activations")
    if rc:
        raise ValueError(f"GGUF experts of types {type13} / {type2} cannot run {h} x {inter} with act={act}")
    return y


def int8_matmul(packed: torch.Tensor, type_name: str, n: int, k: int, isa_name: str, act: str, gated: bool = False
                ) -> Callable[..., torch.Tensor]:
    """linear_int8 for one layer's fixed weight with the checks done once: (x, bias) -> y. A decode
    step calls ~120 of these, so the per-call Python work is what remains (~2 us less a call).
    gated: the weight is a merged [gate; up] pair (n / 2 rows each, n / 2 a multiple of 8) and the
    call returns silu(x gate^T) * (x up^T), [..., n / 2], from one kernel (no bias). out: where to
    write y instead, an fp32 [rows, n] view whose rows may be wider (columns of a larger output, as a
    fused layer's runs of different types fill theirs); x is then 2-D."""
    linear_int8(torch.zeros(1, k), packed, type_name, n, isa_name=isa_name, act=act)   # validates
    if gated and n % 16:
        raise ValueError(f"a gated GGUF matmul needs gate and up parts of whole 8-row groups, got {n} rows")
    kernel, level, levels = _library().gguf_linear_q8, _isa_from_env(isa_name), ACTIVATIONS[act]
    type_id, weight, width = TYPES[type_name], packed.data_ptr(), n // 2 if gated else n

    def call(x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        assert x.shape[-1] == k and packed.data_ptr() == weight   # (and `packed` stays alive with the closure)
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.to(torch.float32).contiguous()
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        assert not (gated and bias is not None)
        if out is None:
            y = torch.empty(x2.shape[0], width, dtype=torch.float32)
        else:
            y = out
            assert (y.dtype == torch.float32 and y.shape == (x2.shape[0], width) and y.stride(-1) == 1
                    and x.dim() == 2 and y.device.type == "cpu")
        b = None if bias is None else bias.data_ptr()
        if kernel(level, type_id, levels, gated, x2.data_ptr(), x2.stride(0), weight, b, y.data_ptr(), y.stride(0),
                  x2.shape[0], n, k):
            raise MemoryError(f"GGUF {type_name} linear: no memory for {x2.shape[0]} x {k} int8 activations")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], width)
    return call


def stack_linear(weight: torch.Tensor, type_name: str, n: int, k: int, isa_name: str, act: str, gated: bool = False,
                 bias: torch.Tensor | None = None) -> decoder_stack.StackLinear:
    """One GGUF layer's matmul for the native decoder stack (kernels/cpu/decoder_stack.py): the weight
    as regrouped by repack (int8 activations, act int16/int8) or the file's rows (act fp32, any type),
    the kernel that multiplies it, and its arguments as int8_matmul / linear pass them."""
    lib, level = _library(), _isa_from_env(isa_name)
    b = None if bias is None else bias.data_ptr()
    if ACTIVATIONS[act] and type_name in INT8_TYPES:
        fn = ctypes.cast(lib.gguf_linear_q8, ctypes.c_void_p).value
        return decoder_stack.StackLinear(kind=decoder_stack.GGUF_INT8, w=weight.data_ptr(), bias=b, fn=fn, n=n, k=k,
                                         isa=level, type=TYPES[type_name], levels=ACTIVATIONS[act], gated=int(gated))
    assert not gated
    fn = ctypes.cast(lib.gguf_linear, ctypes.c_void_p).value
    return decoder_stack.StackLinear(kind=decoder_stack.GGUF_FP32, w=weight.data_ptr(), bias=b, fn=fn, n=n, k=k,
                                     isa=level, type=TYPES[type_name], row_bytes=weight.numel() // max(n, 1))


def stack_experts(w13: torch.Tensor, type13: str, w2: torch.Tensor, type2: str, inter: int, isa_name: str,
                  act: str) -> decoder_stack.StackMoe:
    """A MoE layer's experts for the native decoder stack: moe_int8's kernel (gguf_moe_q8) and the
    arguments moe_int8 passes it for these weights; the router and routing fields are the caller's."""
    assert w13.dtype == w2.dtype == torch.uint8 and w13.is_contiguous() and w2.is_contiguous() and ACTIVATIONS[act]
    return decoder_stack.StackMoe(fn=ctypes.cast(_library().gguf_moe_q8, ctypes.c_void_p).value, w13=w13.data_ptr(),
                                  w2=w2.data_ptr(), w13_bytes=w13[0].numel(), w2_bytes=w2[0].numel(), inter=inter,
                                  isa=_isa_from_env(isa_name), type13=TYPES[type13], type2=TYPES[type2],
                                  levels=ACTIVATIONS[act])


def linear(x: torch.Tensor, weight: torch.Tensor, type_name: str, bias: torch.Tensor | None = None,
           isa_name: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x ([..., K], widened to fp32) @ W^T (+ bias, fp32 [N]) -> fp32 [..., N] with fp32 activations
    (csrc/quant_ops.c). weight: uint8, N rows of K / values-per-block blocks, contiguous ([N, blocks,
    bytes] or [N, row bytes]). out: as int8_matmul's (an fp32 [rows, N] view, rows possibly wider)."""
    k = x.shape[-1]
    x2, bias, level = _prepare(x, bias, isa_name)
    assert weight.dtype == torch.uint8 and weight.is_contiguous()
    n = weight.shape[0]
    if out is None:
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    else:
        y = out
        assert y.dtype == torch.float32 and y.shape == (x2.shape[0], n) and y.stride(-1) == 1 and x.dim() == 2
    rc = _library().gguf_linear(level, TYPES[type_name], x2.data_ptr(), x2.stride(0), weight.data_ptr(),
                                weight.numel() // max(n, 1), None if bias is None else bias.data_ptr(),
                                y.data_ptr(), y.stride(0), x2.shape[0], n, k)
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
