"""INT4 weight-only (W4A16) matmuls in Triton for CUDA, on GPTQ/AWQ weights repacked once into
kernels/quant/int4_layout.py's layout (128 bytes per row per block of 256 inputs).

Each 4-bit value q is turned into the float 1 + q/16 by bit arithmetic alone (the nibble moved to
the top of an fp32 mantissa under a zero exponent: a shift and one mask-and-or), exact in fp32,
bf16 and fp16. The scale and zero point are applied once per group, not per weight:
  sum_k x_k (q_k - z) s = s * (16 * sum_k x_k (1 + q_k/16) - (16 + z) * sum_k x_k),
so the inner loop is the unpacking plus one multiply-add (or one tensor-core dot) per weight.

- `gemv_fma` (1-4 rows, a decode batch): each program owns a strip of output features and streams
  their words once, start to end; plain fp32 FMAs on CUDA cores (no tensor-core tile padded from
  one row to 16, no shared-memory round trip for the operand). Optional gated form for a stacked
  gate_up weight: silu(x Wg^T) * (x Wu^T) in one kernel, as kernels/gemv/triton_gemv.py does.
- `matmul_dot` (more rows, prefill): output tiles over a 2-D grid, the unpacked values go to the
  tensor cores as bf16/fp16 (exact), the group's correction in fp32 after the dot.
- `dequantize`: the whole weight into bf16/fp16, for cuBLAS on very large row counts.
Each kernel begins with `pdl.start(PDL)` (kernels/pdl.py).
"""
from __future__ import annotations

import torch

from shardserve.kernels import pdl
from shardserve.kernels.quant.int4_layout import BLOCK, WORDS
from shardserve.utils import cdiv

FMA_ROWS = 4   # rows up to this: the FMA kernel; more: the tensor-core kernel


try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    @triton.jit
    def nibble(P, i: tl.constexpr):
        """1 + q/16 as fp32, q the i-th nibble of each word of P."""
        if 4 * i >= 19:
            moved = P >> (4 * i - 19)
        else:
            moved = P << (19 - 4 * i)
        return ((moved & (15 << 19)) | 0x3F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def group_params(s_ptr, z_ptr, k0, i: tl.constexpr, k, rows_total, cols, col_ok, GROUP: tl.constexpr):
        """The scale and zero of the group holding run i of the block at k0 (0 where the run starts
        past K)."""
        g = (k0 + 32 * i) // GROUP
        ok = col_ok & (cols * 0 + k0 + 32 * i < k)
        s = tl.load(s_ptr + g * rows_total + cols, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * rows_total + cols, mask=ok, other=0).to(tl.float32)
        return s, z

    @triton.jit
    def gemv_fma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, rows, n, k, words, stride_x, stride_o,
                        GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                        GATED: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        SPAN: tl.constexpr = (GROUP if GROUP < 256 else 256) // 32   # runs per scale application
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        j = tl.arange(0, 32)
        r = tl.arange(0, ROWS)
        rows_total = 2 * n if GATED else n
        w_rows = w_ptr + cols[:, None].to(tl.int64) * words
        acc = tl.zeros([BLOCK_N, ROWS, 32], tl.float32)
        part = tl.zeros([BLOCK_N, ROWS, 32], tl.float32)
        acc_up = tl.zeros([BLOCK_N, ROWS, 32], tl.float32)
        part_up = tl.zeros([BLOCK_N, ROWS, 32], tl.float32)
        xs = tl.zeros([ROWS, 32], tl.float32)
        for k0 in range(0, k, 256):
            wk = k0 // 8 + j
            w_ok = col_ok[:, None] & (wk < words)[None, :]
            P = tl.load(w_rows + wk[None, :], mask=w_ok, other=0)
            if GATED:   # the up half's rows sit n rows below the gate's
                P_up = tl.load(w_rows + n * words + wk[None, :], mask=w_ok, other=0)
            for i in tl.static_range(8):
                kk = k0 + 32 * i + j
                xi = tl.load(x_ptr + r[:, None] * stride_x + kk[None, :], mask=(r[:, None] < rows) & (kk < k)[None, :],
                             other=0.0).to(tl.float32)
                part += nibble(P, i)[:, None, :] * xi[None, :, :]
                if GATED:
                    part_up += nibble(P_up, i)[:, None, :] * xi[None, :, :]
                xs += xi
                if (i + 1) % SPAN == 0:   # the group (or the block, for groups over 256) ends here
                    s, z = group_params(s_ptr, z_ptr, k0, i + 1 - SPAN, k, rows_total, cols, col_ok, GROUP)
                    acc += s[:, None, None] * (16.0 * part - (16.0 + z)[:, None, None] * xs[None, :, :])
                    part = tl.zeros([BLOCK_N, ROWS, 32], tl.float32)
                    if GATED:
                        s, z = group_params(s_ptr, z_ptr, k0, i + 1 - SPAN, k, rows_total, n + cols, col_ok, GROUP)
                        acc_up += s[:, None, None] * (16.0 * part_up - (16.0 + z)[:, None, None] * xs[None, :, :])
                        part_up = tl.zeros([BLOCK_N, ROWS, 32], tl.float32)
                    xs = tl.zeros([ROWS, 32], tl.float32)
        y = tl.sum(acc, axis=2)   # [BLOCK_N, ROWS]
        dt = out_ptr.dtype.element_ty
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        y = y.to(dt)
        if GATED:   # as SiluAndMul on the rounded gate_up output: silu rounded, then the product
            g = y.to(tl.float32)
            sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            y = (sg * tl.sum(acc_up, axis=2).to(dt).to(tl.float32)).to(dt)
        ok = col_ok[:, None] & (r < rows)[None, :]
        tl.store(out_ptr + r[None, :] * stride_o + cols[:, None], y, mask=ok)

    @triton.jit
    def matmul_dot_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, rows, n, k, words, stride_x, stride_o,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                          PDL: tl.constexpr):
        pdl.start(PDL)
        SPAN: tl.constexpr = (GROUP if GROUP < 256 else 256) // 32
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        col_ok = cols < n
        m_ok = m < rows
        j = tl.arange(0, 32)
        w_rows = w_ptr + cols[:, None].to(tl.int64) * words
        x_rows = x_ptr + m[None, :].to(tl.int64) * stride_x
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        part = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        xs = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, k, 256):
            wk = k0 // 8 + j
            P = tl.load(w_rows + wk[None, :], mask=col_ok[:, None] & (wk < words)[None, :], other=0)
            for i in tl.static_range(8):
                kk = k0 + 32 * i + j
                xi = tl.load(x_rows + kk[:, None], mask=m_ok[None, :] & (kk < k)[:, None], other=0.0)   # [32, M]
                part = tl.dot(nibble(P, i).to(dt), xi, part)
                xs += tl.sum(xi.to(tl.float32), axis=0)
                if (i + 1) % SPAN == 0:
                    s, z = group_params(s_ptr, z_ptr, k0, i + 1 - SPAN, k, n, cols, col_ok, GROUP)
                    acc += s[:, None] * (16.0 * part - (16.0 + z)[:, None] * xs[None, :])
                    part = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                    xs = tl.zeros([BLOCK_M], tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        ok = col_ok[:, None] & m_ok[None, :]
        tl.store(out_ptr + m[None, :].to(tl.int64) * stride_o + cols[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=ok)

    @triton.jit
    def dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, n, k, words, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                          PDL: tl.constexpr):
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * 256
        col_ok = cols < n
        j = tl.arange(0, 32)
        wk = k0 // 8 + j
        P = tl.load(w_ptr + cols[:, None].to(tl.int64) * words + wk[None, :], mask=col_ok[:, None], other=0)
        for i in tl.static_range(8):
            kk = k0 + 32 * i + j
            s, z = group_params(s_ptr, z_ptr, k0, i, k, n, cols, col_ok, GROUP)
            w = (16.0 * nibble(P, i) - (16.0 + z)[:, None]) * s[:, None]
            tl.store(out_ptr + cols[:, None].to(tl.int64) * k + kk[None, :], w.to(out_ptr.dtype.element_ty),
                     mask=col_ok[:, None] & (kk < k)[None, :])



def _fma_block_n(n: int) -> int:
    return 16 if n <= 8192 else 32


def gemv_fma(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, group: int,
             bias: torch.Tensor | None = None, gated: bool = False, block_n: int | None = None,
             num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x [rows <= FMA_ROWS..16, K] against the kernel-layout weight [N, ...] (gated: [2 * n, ...],
    gate rows then up rows, result silu(gate) * up [rows, n]); fp32 FMAs."""
    rows = x.shape[0]
    n = words.shape[0] // 2 if gated else words.shape[0]
    block_n = block_n or _fma_block_n(n)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    gemv_fma_kernel[(cdiv(n, block_n),)](
        x, words, scales, zeros, bias if bias is not None else scales, out, rows, n, k, words.shape[1],
        x.stride(0), out.stride(0), GROUP=group, ROWS=max(1, 1 << (rows - 1).bit_length()), BLOCK_N=block_n,
        HAS_BIAS=bias is not None, GATED=gated, num_warps=num_warps, num_stages=num_stages, **pdl.launch_args(x))
    return out


def _dot_tiles(rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for the tensor-core kernel."""
    if rows <= 16:
        return 16, 32, 4, 3
    if rows <= 64:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


def matmul_dot(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, group: int,
               bias: torch.Tensor | None = None, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [rows, K] @ W^T (+ bias) on the tensor cores, W the kernel-layout weight [N, ...]."""
    rows, n = x.shape[0], words.shape[0]
    block_m, block_n, warps, stages = tiles or _dot_tiles(rows)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    matmul_dot_kernel[(cdiv(n, block_n), cdiv(rows, block_m))](
        x, words, scales, zeros, bias if bias is not None else scales, out, rows, n, k, words.shape[1],
        x.stride(0), out.stride(0), GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=bias is not None,
        num_warps=warps, num_stages=stages, **pdl.launch_args(x))
    return out


def dequantize(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, group: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The kernel-layout weight as a [N, K] tensor of `dtype`."""
    n = words.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    block_n = 32
    dequantize_kernel[(cdiv(n, block_n), cdiv(k, BLOCK))](words, scales, zeros, out, n, k, words.shape[1], GROUP=group,
                                                      BLOCK_N=block_n, num_warps=4, **pdl.launch_args(words))
    return out


assert WORDS == 32 and BLOCK == 256   # the kernels' literal 32s and 256s
