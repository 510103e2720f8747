"""Per-token FP8 quantization of activations, in one Triton pass: each program reads a block of rows
once, finds each row's absolute maximum, and writes the E4M3 row and its fp32 scale (amax / 448).
What `quantization/fp8.quantize_tokens` computes with six torch kernels (widen, abs, amax, divide,
clamp, narrow), each a full pass over the activations; before a `_scaled_mm` those passes cost more
than the FP8 matmul saves over bf16 at decode-sized batches.

`quantize_token_groups`: a scale per token and group of 128 inputs instead (DeepSeek-V3's 1 x 128
activation blocks, for the block-scaled `_scaled_mm` of kernels/quant/triton_fp8_block.py), the
rows padded with zeros to a multiple of 4 and the scales stored group-major, as cuBLAS takes them."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12   # a row of zeros gets this scale (and zeros), as the torch reference does

if triton is not None:
    _MAX = tl.constexpr(FP8_MAX)
    _MIN_SCALE = tl.constexpr(MIN_SCALE)

    @triton.jit
    def quant_rows_kernel(x_ptr, q_ptr, s_ptr, k, stride_x, stride_q,
                          BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        q_row = q_ptr + row.to(tl.int64) * stride_q
        if ONE_PASS:   # the row fits one block: read it once
            cols = tl.arange(0, BLOCK_K)
            x = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=0) / _MAX, _MIN_SCALE)
            q = tl.clamp(tl.math.div_rn(x, scale), -_MAX, _MAX)   # rounded as torch divides
            tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < k)
        else:          # two passes over a long row; the second read comes from L2
            amax = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, k, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, axis=0) / _MAX, _MIN_SCALE)
            for k0 in range(0, k, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
                q = tl.clamp(tl.math.div_rn(x, scale), -_MAX, _MAX)   # rounded as torch divides
                tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < k)
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


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (E4M3 [M, K], fp32 scales [M, 1]), one scale per token."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    one_pass = k <= 8192
    block = triton.next_power_of_2(k) if one_pass else 4096
    quant_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=block, ONE_PASS=one_pass,
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
