"""Fused small layers for CUDA in Triton: RMSNorm with the residual add, SiLU-and-mul, and rotary
embedding applied in place to q and k (its kernels live in triton_rope.py). Each replaces several
torch kernels per layer (a decode step on a GPU is made of hundreds of these tiny launches). They
round where the torch code rounds (to bf16 after each op the torch path does in bf16), so the two
paths agree within one bf16 ulp.
"""
from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import torch

from shardserve.layers import pdl


# Warps of every RMSNorm launch: the sum of squares is reduced in an order set by the warp count, so
# kernels that norm the same rows (this one, distributed/fused_allreduce.py) share it to agree bit
# for bit.
NORM_WARPS = 4


@functools.cache
def available() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def handles(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors) and available()


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm(x, res, w, res_ptr, out_ptr, row, cols, mask, n_cols, eps, HAS_RES: tl.constexpr):
        """Stores rmsnorm(x) * w for row `row` (also used by distributed/fused_allreduce.py). x, res
        and w: the row's values, loaded by the caller (which may load them early). With HAS_RES,
        x + res first, in the activations' dtype as torch adds them, stored back as the new residual."""
        if HAS_RES:
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
            tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        normed = (xf * inv).to(x.dtype).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (normed * w.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
        pdl.start(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        res = x   # unused without a residual
        if HAS_RES:
            res = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        add_rms_norm(x, res, w, res_ptr, out_ptr, row, cols, mask, n_cols, eps, HAS_RES)

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        g = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(out_ptr + row * d + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(triton=triton, add_rms_norm=add_rms_norm, rms_norm=rms_norm_kernel,
                           silu_mul=silu_mul_kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """rmsnorm(x) * weight; with residual, residual += x in place first (x, residual contiguous)."""
    k = _kernels()
    n = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // n
    k.rms_norm[(rows,)](x, residual if residual is not None else x, weight, out, n, eps,
                        HAS_RES=residual is not None, BLOCK=k.triton.next_power_of_2(n), num_warps=NORM_WARPS,
                        **pdl.launch_args(x))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    k = _kernels()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows = x.numel() // (2 * d)
    block = 1024
    k.silu_mul[(rows, k.triton.cdiv(d, block))](x, out, d, BLOCK=block)
    return out


def rotary_neox_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """NeoX-style rotation of q [T, Hq, D] and k [T, Hk, D] in place (head rows packed)."""
    from shardserve.layers import triton_rope
    triton_rope.rotary_neox_(positions, q, k, cos, sin)
