"""INT4 weight-only (W4A16) matmuls in Triton for CUDA, on GPTQ/AWQ weights repacked once into
kernels/quant/int4_layout.py's layout (per row, blocks of 8 runs of RUN inputs in RUN int32 words).
Zero points are uint8 (w = (q - z) s); fp16 "zeros" are mins instead (w = q s - m: GGUF's Q4_1 and
Q4_K, kernels/quant/gguf_layout.py), the kernels' arithmetic picked by their dtype.

Each 4-bit value q becomes the float 1 + q/16 by bit arithmetic alone (the nibble moved to the top
of an fp32 mantissa under a zero exponent: a shift and one mask-and-or), and one multiply-add with
the run's group constants, 16 s and -(16 + z) s, turns it into the weight (q - z) s in fp32. A run
lies in one group, so those constants are loaded once per run of RUN inputs.

- `gemv_fma` (1-4 rows, a decode batch): each program owns a strip of output features and streams
  their words once, start to end, loading the next block before it works on the current one (the
  compiler pipelines only loads that feed a dot, so this keeps two blocks in flight); fp32 FMAs on
  CUDA cores, no tensor-core tile padded from one row to 16. The gated form computes
  silu(x Wg^T) * (x Wu^T) for a stacked gate_up weight, as kernels/gemv/triton_gemv.py does.
- `matmul_dot` (5-64 rows): output tiles over a 2-D grid, the weights rounded to bf16/fp16 as the
  reference rounds them, then the tensor cores (16 rows a tile up to 16 rows; 17-64 rows one tile
  of 64 with one pipeline stage, a step's eight runs of activations filling shared memory, and K in
  parts: split-K, kernels/quant/splitk.py).
- `dequantize`: the whole weight into bf16/fp16, for cuBLAS on large row counts.
Each kernel begins with `pdl.start(PDL)` (kernels/pdl.py). Tile settings: kernels/quant/tuned.py.
"""
from __future__ import annotations

import torch

from shardserve.kernels import pdl
from shardserve.kernels.quant import splitk, tuned
from shardserve.utils import cdiv

FMA_ROWS = 4   # rows up to this: the FMA kernel
# matmul_dot's tiles for 17-64 rows (BLOCK_M, BLOCK_N, warps, stages, split-K parts): the fastest over
# Llama-3-8B's four layers at 32 and 64 rows on an H200, groups of 128 and of 32 (BENCHMARKS.md, session 36)
DOT_TILES_TO_64 = (64, 64, 4, 1, 4)

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
    def dequant_run(P, i: tl.constexpr, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, GROUP: tl.constexpr,
                    RUN: tl.constexpr):
        """Run i of the block at k0 as fp32 weights [BLOCK_N, RUN], (q - z) * s (fp16 "zeros": mins,
        q * s - m); 0 where the run starts past K."""
        g = (k0 + RUN * i) // GROUP
        ok = col_ok & (cols * 0 + k0 + RUN * i < k)
        s = tl.load(s_ptr + g * rows_total + cols, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * rows_total + cols, mask=ok, other=0).to(tl.float32)
        if z_ptr.dtype.element_ty == tl.float16:
            return nibble(P, i) * (16.0 * s)[:, None] - (16.0 * s + z)[:, None]
        return nibble(P, i) * (16.0 * s)[:, None] - ((16.0 + z) * s)[:, None]

    @triton.jit
    def gemv_fma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, rows, n, k, words, stride_x, stride_o,
                        GROUP: tl.constexpr, RUN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        BLOCK: tl.constexpr = 8 * RUN
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        j = tl.arange(0, RUN)
        r = tl.arange(0, ROWS)
        rows_total = 2 * n if GATED else n
        w_rows = w_ptr + cols[:, None].to(tl.int64) * words
        w_up = w_ptr + (n + cols[:, None]).to(tl.int64) * words   # the up half's rows (gated)
        P = tl.load(w_rows + j[None, :], mask=col_ok[:, None], other=0)   # block 0 (every row has one)
        if GATED:
            P_up = tl.load(w_up + j[None, :], mask=col_ok[:, None], other=0)
        if ROWS == 1:
            acc = tl.zeros([BLOCK_N, RUN], tl.float32)
            acc_up = tl.zeros([BLOCK_N, RUN], tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, ROWS, RUN], tl.float32)
            acc_up = tl.zeros([BLOCK_N, ROWS, RUN], tl.float32)
        for k0 in range(0, k, BLOCK):
            nxt = (k0 + BLOCK) // 8 + j   # the next block's words, in flight while this one is used
            nxt_ok = col_ok[:, None] & (nxt < words)[None, :]
            P_next = tl.load(w_rows + nxt[None, :], mask=nxt_ok, other=0)
            if GATED:
                P_up_next = tl.load(w_up + nxt[None, :], mask=nxt_ok, other=0)
            for i in tl.static_range(8):
                kk = k0 + RUN * i + j
                w = dequant_run(P, i, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, GROUP, RUN)
                if GATED:
                    w_u = dequant_run(P_up, i, s_ptr, z_ptr, k0, k, rows_total, n + cols, col_ok, GROUP, RUN)
                if ROWS == 1:
                    x = tl.load(x_ptr + kk, mask=kk < k, other=0.0).to(tl.float32)
                    acc += w * x[None, :]
                    if GATED:
                        acc_up += w_u * x[None, :]
                else:
                    x = tl.load(x_ptr + r[:, None] * stride_x + kk[None, :],
                                mask=(r[:, None] < rows) & (kk < k)[None, :], other=0.0).to(tl.float32)
                    acc += w[:, None, :] * x[None, :, :]
                    if GATED:
                        acc_up += w_u[:, None, :] * x[None, :, :]
            P = P_next
            if GATED:
                P_up = P_up_next
        if ROWS == 1:
            y = tl.sum(acc, axis=1)[:, None]
            y_up = tl.sum(acc_up, axis=1)[:, None]
        else:
            y = tl.sum(acc, axis=2)   # [BLOCK_N, ROWS]
            y_up = tl.sum(acc_up, axis=2)
        splitk.finish(y, y_up, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o, HAS_BIAS, GATED)

    @triton.jit
    def matmul_dot_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, rows, n, k, words, stride_x,
                          stride_o, GROUP: tl.constexpr, RUN: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        # Grid: (strips, row tiles), or with SPLIT > 1 (one row tile) (strips, parts of K): split-K,
        # kernels/quant/splitk.py.
        pdl.start(PDL)
        BLOCK: tl.constexpr = 8 * RUN
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = (tl.program_id(1) * BLOCK_M if SPLIT == 1 else 0) + tl.arange(0, BLOCK_M)
        col_ok = cols < n
        m_ok = m < rows
        j = tl.arange(0, RUN)
        w_rows = w_ptr + cols[:, None].to(tl.int64) * words
        x_rows = x_ptr + m[None, :].to(tl.int64) * stride_x
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        blocks = tl.cdiv(k, BLOCK)
        per = tl.cdiv(blocks, SPLIT)
        first = tl.program_id(1) * per if SPLIT > 1 else 0
        first_ok = (j * 0 + first < blocks)[None, :]   # a part may start past K's blocks: nothing to load
        P = tl.load(w_rows + first * (BLOCK // 8) + j[None, :], mask=col_ok[:, None] & first_ok, other=0)
        for blk in range(first, tl.minimum(first + per, blocks)):
            k0 = blk * BLOCK
            nxt = (k0 + BLOCK) // 8 + j
            P_next = tl.load(w_rows + nxt[None, :], mask=col_ok[:, None] & (nxt < words)[None, :], other=0)
            for i in tl.static_range(8):
                kk = k0 + RUN * i + j
                x = tl.load(x_rows + kk[:, None], mask=m_ok[None, :] & (kk < k)[:, None], other=0.0)   # [RUN, M]
                w = dequant_run(P, i, s_ptr, z_ptr, k0, k, n, cols, col_ok, GROUP, RUN).to(dt)
                acc = tl.dot(w, x, acc)
            P = P_next
        splitk.reduce_and_finish(acc, acc, ws_ptr, cnt_ptr, n, out_ptr, b_ptr, cols, col_ok, m, rows, stride_o, SPLIT,
                                 HAS_BIAS, False)

    @triton.jit
    def dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, n, k, words, GROUP: tl.constexpr, RUN: tl.constexpr,
                          BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * 8 * RUN
        col_ok = cols < n
        j = tl.arange(0, RUN)
        P = tl.load(w_ptr + cols[:, None].to(tl.int64) * words + (k0 // 8 + j)[None, :], mask=col_ok[:, None], other=0)
        for i in tl.static_range(8):
            kk = k0 + RUN * i + j
            w = dequant_run(P, i, s_ptr, z_ptr, k0, k, n, cols, col_ok, GROUP, RUN)
            tl.store(out_ptr + cols[:, None].to(tl.int64) * k + kk[None, :], w.to(out_ptr.dtype.element_ty),
                     mask=col_ok[:, None] & (kk < k)[None, :])


def _fma_tiles(x: torch.Tensor, n: int, k: int, gated: bool) -> tuple[int, int]:
    """(BLOCK_N, warps): tuned for this GPU and shape, else narrow strips (many programs: the best
    or near it on the 8B shapes that are not in the table)."""
    found = tuned.lookup("int4_fma", n, k, gated, x.shape[0], x.device)
    return tuple(found) if found else (8, 2)


def gemv_fma(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, group: int,
             run: int, bias: torch.Tensor | None = None, gated: bool = False,
             tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """x [rows <= FMA_ROWS, K] against the kernel-layout weight [N, ...] (gated: [2 * n, ...], gate
    rows then up rows, result silu(gate) * up [rows, n]); fp32 FMAs."""
    if gated and bias is not None:
        raise ValueError("the gated form takes no bias")
    rows = x.shape[0]
    n = words.shape[0] // 2 if gated else words.shape[0]
    block_n, warps = tiles or _fma_tiles(x, n, k, gated)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    gemv_fma_kernel[(cdiv(n, block_n),)](
        x, words, scales, zeros, bias if bias is not None else scales, out, rows, n, k, words.shape[1],
        x.stride(0), out.stride(0), GROUP=group, RUN=run, ROWS=max(1, 1 << (rows - 1).bit_length()),
        BLOCK_N=block_n, HAS_BIAS=bias is not None, GATED=gated, num_warps=warps, num_stages=1,
        **pdl.launch_args(x))
    return out


def _dot_tiles(x: torch.Tensor, n: int, k: int) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, warps, stages[, SPLIT]) for the tensor-core kernel: tuned for this GPU and
    shape, else 16 rows a tile up to 16 rows (the eight runs of x a step are pipelined through shared
    memory), DOT_TILES_TO_64 past that (one pipeline stage, one row tile, split-K)."""
    found = tuned.lookup("int4_dot", n, k, False, x.shape[0], x.device) if x.is_cuda else None
    if found:
        return tuple(found)
    rows = x.shape[0]
    return (16, 64, 4, 2) if rows <= 16 else DOT_TILES_TO_64


def matmul_dot(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, group: int,
               run: int, bias: torch.Tensor | None = None, tiles: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [rows, K] @ W^T (+ bias) on the tensor cores, W the kernel-layout weight [N, ...]; tiles
    (BLOCK_M, BLOCK_N, warps, stages[, SPLIT parts of K, for rows <= BLOCK_M])."""
    rows, n = x.shape[0], words.shape[0]
    block_m, block_n, warps, stages, *parts = tiles or _dot_tiles(x, n, k)
    split = min(parts[0], cdiv(k, 8 * run)) if parts and rows <= block_m else 1
    while split > 1 and split * block_m * 2 * n > splitk.MIN_FLOATS:   # the standing workspace holds the parts
        split //= 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (cdiv(n, block_n), split if split > 1 else cdiv(rows, block_m))
    ws, counters = splitk.buffers(x.device, split * block_m * 2 * n, grid[0]) if split > 1 else (out, out)
    matmul_dot_kernel[grid](
        x, words, scales, zeros, bias if bias is not None else scales, out, ws, counters, rows, n, k, words.shape[1],
        x.stride(0), out.stride(0), GROUP=group, RUN=run, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split,
        HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages, **pdl.launch_args(x))
    return out


def dequantize(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, group: int, run: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The kernel-layout weight as a [N, K] tensor of `dtype`."""
    n = words.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    block_n = 32
    dequantize_kernel[(cdiv(n, block_n), cdiv(k, 8 * run))](words, scales, zeros, out, n, k, words.shape[1],
                                                            GROUP=group, RUN=run, BLOCK_N=block_n, num_warps=4,
                                                            **pdl.launch_args(words))
    return out
