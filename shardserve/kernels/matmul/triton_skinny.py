"""Matmuls of decode-sized batches (17-256 rows) in Triton, for CUDA: y = x @ w^T with w [N, K] as
checkpoints store it, bf16/fp16 or FP8 E4M3 (then with a scale per row of x and per row of w, the
W8A8 layout of quantization/fp8.py), bias optional. Between the weight-streaming GEMVs (1-16 rows,
kernels/gemv, kernels/quant) and prefill-sized matmuls lie batches whose matmuls are bound by
compute and bytes about equally. There `torch._scaled_mm`'s FP8 kernels ran 1.0-1.5x slower than
these tiles on Llama-3-8B's shapes on an H100 (benchmarks/skinny_matmul.py), so FP8 layers use them
where that GPU's tuned table (kernels/quant/tuned.py, "mm_fp8" keys) says they won; in bf16 cuBLAS
was as fast or faster, and stays. SHARDSERVE_SKINNY_MATMUL=0: `_scaled_mm` everywhere (A/B runs).

Tiles of BLOCK_M rows x BLOCK_N outputs; programs are ordered so that the row tiles of one strip of
the weight run side by side (the strip comes from HBM once, the other reads hit L2)."""
from __future__ import annotations

import os

import torch

from shardserve.kernels.quant import tuned

ENABLED = os.environ.get("SHARDSERVE_SKINNY_MATMUL", "1") != "0"

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    @triton.jit(do_not_specialize=["m"])   # a batch's row count: one variant for all
    def skinny_mm_kernel(x_ptr, w_ptr, out_ptr, xs_ptr, ws_ptr, b_ptr, m, n, k, stride_x, stride_w, stride_o,
                         SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(m, BLOCK_M)
        pid_m = pid % tiles_m
        pid_n = pid // tiles_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :]
        w_tile = w_ptr + cols[:, None].to(tl.int64) * stride_w + kk[None, :]
        row_ok = rows[:, None] < m
        col_ok = cols[:, None] < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            a = tl.load(x_tile, mask=row_ok & (kk[None, :] + k0 < k), other=0.0)
            b = tl.load(w_tile, mask=col_ok & (kk[None, :] + k0 < k), other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            x_tile += BLOCK_K
            w_tile += BLOCK_K
        if SCALED:
            acc = acc * tl.load(xs_ptr + rows, mask=rows < m, other=0.0)[:, None]
            acc = acc * tl.load(ws_ptr + cols, mask=cols < n, other=0.0)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok & (cols[None, :] < n))


MIN_ROWS, MAX_ROWS = 17, 256   # below: the GEMVs; above: `_scaled_mm`


def fp8_tiles(n: int, k: int, rows: int, device: torch.device) -> tuple | None:
    """The tiles measured fastest for an FP8 [n, k] weight at this row count on this GPU, or None
    where `torch._scaled_mm` was (or nothing was measured)."""
    if not (ENABLED and tuned.ENABLED and MIN_ROWS <= rows <= MAX_ROWS and device.type == "cuda"):
        return None
    pick = tuned.lookup("mm_fp8", n, k, False, rows, device)
    return tuple(pick) if pick and pick != ["scaled_mm"] else None


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, tiles: tuple[int, int, int, int, int] = (64, 64, 128, 4, 4)):
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] of out_dtype (default x's). FP8 x and weight
    take x_scale [M] or [M, 1] and w_scale [N] (fp32). tiles: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    m, k = x.shape
    n = weight.shape[0]
    block_m, block_n, block_k, warps, stages = tiles
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    scaled = x_scale is not None
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    skinny_mm_kernel[grid](x, weight, out, x_scale if scaled else out, w_scale if scaled else out,
                           bias if bias is not None else out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                           SCALED=scaled, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                           BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out
