"""Per-token FP8 quantization of activations, in one Triton pass: each program reads a block of rows
once, finds each row's absolute maximum, and writes the E4M3 row and its fp32 scale (amax / 448).
What `quantization/fp8.quantize_tokens` computes with six torch kernels (widen, abs, amax, divide,
clamp, narrow), each a full pass over the activations; before a `_scaled_mm` those passes cost more
than the FP8 matmul saves over bf16 at decode-sized batches.

`quantize_token_groups`: a scale per token and group of 128 inputs instead (DeepSeek-V3's 1 x 128
activation blocks, for the block-scaled `_scaled_mm` of kernels/quant/triton_fp8_block.py), the
rows padded with zeros to a multiple of 4 and the scales stored group-major, as cuBLAS takes them.

`quantize_tokens(x, torch.int8)`: the same pass rounding to INT8 (scale amax / 127, round half to even)
for the W8A8 INT8 matmul of quantization/int8.py.

`store_quantized_row` is the per-token rounding as a piece other kernels end with: the RMSNorm and
SiLU-and-mul kernels quantize their own output for the FP8 matmul that takes it next, one pass over
the activations fewer (they hand over `Fp8Rows`)."""
from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
MIN_SCALE = 1e-12   # a row of zeros gets this scale (and zeros), as the torch reference does


class Fp8Rows(NamedTuple):
    """Activations already quantized per token for an FP8 matmul (what quantize_tokens returns),
    and the dtype of the activations they were made from, which the matmul's output takes."""
    q: torch.Tensor       # E4M3 [M, K]
    scale: torch.Tensor   # fp32 [M, 1]
    dtype: torch.dtype


def empty_rows(m: int, k: int, dtype: torch.dtype, device: torch.device) -> Fp8Rows:
    return Fp8Rows(torch.empty((m, k), dtype=FP8, device=device),
                   torch.empty((m, 1), dtype=torch.float32, device=device), dtype)


if triton is not None:
    _MAX = tl.constexpr(FP8_MAX)
    _MIN_SCALE = tl.constexpr(MIN_SCALE)

    # The rounding of quantize_tokens, in pieces other kernels use (the module docstring).
    @triton.jit
    def row_scale_to(amax, QMAX: tl.constexpr):
        """A row's scale from its (elementwise) absolute maxima, for values saturating at QMAX."""
        return tl.maximum(tl.max(amax, axis=0) / QMAX, _MIN_SCALE)

    @triton.jit
    def row_scale(amax):
        return row_scale_to(amax, _MAX)

    @triton.jit
    def round_half_even(q):
        """torch.round's rule, exactly: |q|'s fraction (exact: floor(a) is 0 or at least a / 2) decides,
        a tie going to the even neighbour. (libdevice's rint has no form under Triton's interpreter.)"""
        a = tl.abs(q)
        r = tl.floor(a)
        frac = a - r
        up = (frac > 0.5) | ((frac == 0.5) & ((r.to(tl.int32) & 1) == 1))
        r = tl.where(up, r + 1.0, r)
        return tl.where(q < 0, -r, r)

    @triton.jit
    def to_quantized(y, scale, q_ptrs, mask, QMAX: tl.constexpr):
        """Stores y / scale (fp32, torch's division, saturated at QMAX) as q_ptrs' type: E4M3, or INT8
        rounded half to even."""
        q = tl.math.div_rn(y, scale)
        if q_ptrs.dtype.element_ty == tl.int8:
            q = round_half_even(q)
        tl.store(q_ptrs, tl.clamp(q, -QMAX, QMAX).to(q_ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def to_e4m3(y, scale, q_ptrs, mask):
        to_quantized(y, scale, q_ptrs, mask, _MAX)

    @triton.jit
    def store_quantized_row(y, q_row, s_ptr, cols, mask):
        """One whole row y (fp32, masked lanes zero) to E4M3 at q_row + cols and its scale at s_ptr."""
        scale = row_scale(tl.abs(y))
        to_e4m3(y, scale, q_row + cols, mask)
        tl.store(s_ptr, scale)

    @triton.jit
    def quant_rows_kernel(x_ptr, q_ptr, s_ptr, k, stride_x, stride_q,
                          BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, QMAX: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        q_row = q_ptr + row.to(tl.int64) * stride_q
        if ONE_PASS:   # the row fits one block: read it once
            cols = tl.arange(0, BLOCK_K)
            x = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
            scale = row_scale_to(tl.abs(x), QMAX)
            to_quantized(x, scale, q_row + cols, cols < k, QMAX)
        else:          # two passes over a long row; the second read comes from L2
            amax = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, k, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = row_scale_to(amax, QMAX)
            for k0 in range(0, k, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
                to_quantized(x, scale, q_row + cols, cols < k, QMAX)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def quant_groups_kernel(x_ptr, q_ptr, s_ptr, m, k, stride_x, stride_q, stride_s, GROUP: tl.constexpr,
                            GROUPS: tl.constexpr):
        row = tl.program_id(0)
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]          # [GROUPS, GROUP]
        ok = (cols < k) & (cols * 0 + row < m)                            # rows past m: the zero padding
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1) / _MAX, _MIN_SCALE)
        q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -_MAX, _MAX)
        tl.store(q_ptr + row.to(tl.int64) * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < k)
        tl.store(s_ptr + g * stride_s + row, scale, mask=g * GROUP < k)


def handles(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 0


def quantize_tokens(x: torch.Tensor, dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (E4M3 or INT8 [M, K], fp32 scales [M, 1]), one scale per token."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    one_pass = k <= 8192
    block = triton.next_power_of_2(k) if one_pass else 4096
    quant_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=block, ONE_PASS=one_pass,
                            QMAX=INT8_MAX if dtype == torch.int8 else FP8_MAX,
                            num_warps=8 if block >= 4096 else 4)
    return q, scale


def quantize_token_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (E4M3 [M4, K], fp32 scales [M4, ceil(K / group)] with strides (1, M4)),
    one scale per token and group of inputs; M4 = M rounded up to a multiple of 4, the extra rows zero."""
    m, k = x.shape
    m4, groups = -(-m // 4) * 4, -(-k // group)
    q = torch.empty((m4, k), dtype=FP8, device=x.device)
    scales = torch.empty((groups, m4), dtype=torch.float32, device=x.device)
    per = min(8, triton.next_power_of_2(groups))
    quant_groups_kernel[(m4, -(-groups // per))](x, q, scales, m, k, x.stride(0), q.stride(0), scales.stride(0),
                                                 GROUP=group, GROUPS=per, num_warps=4)
    return q, scales.t()
