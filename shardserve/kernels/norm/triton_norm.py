"""RMSNorm with the residual add, for CUDA in Triton: one launch instead of several torch kernels per
layer (a decode step on a GPU is made of hundreds of these tiny launches). It rounds where the
torch code (kernels/norm/reference.py) rounds, so the two agree within one bf16 ulp.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from shardserve.kernels import pdl

# Warps of every RMSNorm launch: the sum of squares is reduced in an order set by the warp count, so
# kernels that norm the same rows (this one, kernels/allreduce/triton_allreduce.py) share it to agree
# bit for bit.
NORM_WARPS = 4


try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    from shardserve.kernels.quant.triton_fp8_quant import empty_rows, store_quantized_row

    # At module level (not inside _kernels) so Triton's interpreter, which CI runs the norm under, finds them.
    @triton.jit
    def residual_rms_norm(x, res, w, res_ptr, row, cols, mask, n_cols, eps, HAS_RES: tl.constexpr):
        """rmsnorm(x) * w for row `row`, in fp32 before its rounding to the activations' dtype. x, res
        and w: the row's values, loaded by the caller (which may load them early). With HAS_RES,
        x + res first, in the activations' dtype as torch adds them, stored back as the new residual."""
        if HAS_RES:
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
            tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        normed = (xf * inv).to(x.dtype).to(tl.float32)
        return normed * w.to(tl.float32)

    @triton.jit
    def add_rms_norm(x, res, w, res_ptr, out_ptr, row, cols, mask, n_cols, eps, HAS_RES: tl.constexpr):
        """Stores residual_rms_norm's row (also used by kernels/allreduce/triton_allreduce.py)."""
        y = residual_rms_norm(x, res, w, res_ptr, row, cols, mask, n_cols, eps, HAS_RES)
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, s_ptr, n_cols, eps, heads, stride_t, HAS_RES: tl.constexpr,
                        QUANT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Row r of x is head r % heads of token r // heads: at (r // heads) * stride_t + (r % heads) * n_cols
        (heads 1 and stride_t n_cols: plain rows). out and res are contiguous rows. QUANT: out is E4M3,
        each row rounded to the activations' dtype and then quantized with its scale stored at s_ptr."""
        pdl.start(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + (row // heads).to(tl.int64) * stride_t + (row % heads) * n_cols + cols, mask=mask,
                    other=0.0)
        res = x   # unused without a residual
        if HAS_RES:
            res = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        if QUANT:
            y = residual_rms_norm(x, res, w, res_ptr, row, cols, mask, n_cols, eps, HAS_RES)
            store_quantized_row(y.to(x.dtype).to(tl.float32), out_ptr + row * n_cols, s_ptr + row, cols, mask)
        else:
            add_rms_norm(x, res, w, res_ptr, out_ptr, row, cols, mask, n_cols, eps, HAS_RES)

    return SimpleNamespace(triton=triton, add_rms_norm=add_rms_norm, rms_norm=rms_norm_kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quantize: bool = False):
    """rmsnorm(x) * weight over the last dim; with residual, residual += x in place first (x, residual
    contiguous). Without one, x may also be [T, heads, D] with each token's heads packed in a wider row
    (q or k inside a fused qkv row: Qwen3's per-head norms), read where it lies; out is contiguous.
    quantize (x [M, K] contiguous): the output quantized per token for an FP8 matmul, as Fp8Rows,
    equal to triton_fp8_quant.quantize_tokens of the norm's output."""
    k = _kernels()
    n = x.shape[-1]
    if x.is_contiguous():
        heads, stride_t = 1, n
    else:
        assert residual is None and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == n, "packed heads only"
        heads, stride_t = x.shape[1], x.stride(0)
    rows = x.numel() // n
    if quantize:
        assert x.dim() == 2 and x.is_contiguous(), "quantized rows: plain [tokens, hidden] rows only"
        out = empty_rows(rows, n, x.dtype, x.device)
        dst, scales = out.q, out.scale
    else:
        out = dst = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        scales = weight   # unused (and no new compiled variant: the weight's dtype picks one already)
    k.rms_norm[(rows,)](x, residual if residual is not None else x, weight, dst, scales, n, eps, heads, stride_t,
                        HAS_RES=residual is not None, QUANT=quantize, BLOCK=k.triton.next_power_of_2(n),
                        num_warps=NORM_WARPS, **pdl.launch_args(x))
    return out
