"""SiLU-and-mul for a fused gate_up projection, for CUDA in Triton: one launch instead of three torch
kernels. It rounds where the torch code (kernels/activation/reference.py) rounds."""
from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

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

    return triton, silu_mul_kernel


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for contiguous x."""
    triton, kernel = _kernel()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows = x.numel() // (2 * d)
    block = 1024
    kernel[(rows, triton.cdiv(d, block))](x, out, d, BLOCK=block)
    return out
