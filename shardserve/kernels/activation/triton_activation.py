"""SiLU-and-mul for a fused gate_up projection, for CUDA in Triton: one launch instead of three torch
kernels. It rounds where the torch code (kernels/activation/reference.py) rounds.

`quantize=True`: the output quantized per token for the FP8 matmul that takes it next (down_proj),
in the same kernel: one program per row computes the row, finds its absolute maximum and stores it
as E4M3 (a row too long to hold is computed twice, the second time from L2). Bit for bit what
triton_fp8_quant.quantize_tokens makes of the bf16 output, without writing and reading that output."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

# The quantizing kernel holds a row of up to this many outputs in registers (one pass; 8B's 14336
# at TP=1); longer rows take two passes of QUANT_BLOCK columns (the second recomputes the row).
ONE_PASS_MAX = 16384
QUANT_BLOCK = 4096

if triton is not None:
    from shardserve.kernels.quant.triton_fp8_quant import empty_rows, row_scale, store_quantized_row, to_e4m3

    # At module level so Triton's interpreter (the CPU tests) finds the helper.
    @triton.jit
    def _silu_mul(x_row, cols, d):
        """silu(gate) * up at `cols` of one row, rounded to the activations' dtype, in fp32 (0 past d)."""
        mask = cols < d
        g = tl.load(x_row + cols, mask=mask, other=0.0)
        u = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        return (s * u).to(g.dtype).to(tl.float32)

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        y = _silu_mul(x_ptr + row.to(tl.int64) * 2 * d, cols, d)
        tl.store(out_ptr + row.to(tl.int64) * d + cols, y.to(out_ptr.dtype.element_ty), mask=cols < d)

    @triton.jit
    def silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, d, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * 2 * d
        q_row = q_ptr + row.to(tl.int64) * d
        if d <= BLOCK:   # the row fits one block: computed once
            cols = tl.arange(0, BLOCK)
            store_quantized_row(_silu_mul(x_row, cols, d), q_row, s_ptr + row, cols, cols < d)
        else:
            amax = tl.zeros([BLOCK], tl.float32)
            for c0 in range(0, d, BLOCK):
                amax = tl.maximum(amax, tl.abs(_silu_mul(x_row, c0 + tl.arange(0, BLOCK), d)))
            scale = row_scale(amax)
            for c0 in range(0, d, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                to_e4m3(_silu_mul(x_row, cols, d), scale, q_row + cols, cols < d)
            tl.store(s_ptr + row, scale)


def silu_and_mul(x: torch.Tensor, quantize: bool = False):
    """silu(x[..., :d]) * x[..., d:] for contiguous x; quantize (x [M, 2d]): as Fp8Rows."""
    d = x.shape[-1] // 2
    rows = x.numel() // (2 * d)
    if quantize:
        assert x.dim() == 2 and x.is_contiguous(), "quantized rows: plain [tokens, 2 * d] rows only"
        out = empty_rows(rows, d, x.dtype, x.device)
        block = triton.next_power_of_2(d) if d <= ONE_PASS_MAX else QUANT_BLOCK
        warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
        silu_mul_quant_kernel[(rows,)](x, out.q, out.scale, d, BLOCK=block, num_warps=warps)
        return out
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    block = 1024
    silu_mul_kernel[(rows, triton.cdiv(d, block))](x, out, d, BLOCK=block)
    return out
