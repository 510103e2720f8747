"""The FP8 KV cache (`--kv-cache-dtype fp8`) in plain torch: the reference every kernel's fp8 pool
matches.

An fp8 pool is `torch.float8_e4m3fn`: one byte per value, half the bytes of bf16, so twice the
tokens per byte of KV memory. Each attention layer has one scale for its keys and one for its values
(vLLM's `k_scale` / `v_scale`, 1.0 unless the checkpoint gives them): the pool holds x / scale
rounded to nearest even and saturated at +-448 (E4M3 has no infinity; its largest finite value is
448), and a read gives the stored value times the scale, in fp32.
"""
from __future__ import annotations

import torch

FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV).max)   # 448


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> E4M3 of x / scale (an IEEE fp32 division), saturated. The divisor is
    a tensor on x's device: torch on CUDA multiplies by the reciprocal of a Python-number divisor,
    which rounds differently, and bf16 inputs land on E4M3 rounding ties often enough to show it."""
    divisor = torch.full((), scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E4M3 values -> value * scale (in fp32), then `dtype`."""
    return (x.float() * scale).to(dtype)


def store(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """New K or V as the pool stores them: quantized for an fp8 pool, else cast."""
    return quantize(x, scale) if is_fp8(cache_dtype) else x.to(cache_dtype)


def load(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """K or V read from a pool in `dtype`: dequantized if fp8, else cast."""
    return dequantize(x, scale, dtype) if is_fp8(x.dtype) else x.to(dtype)
