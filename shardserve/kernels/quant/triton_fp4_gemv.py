"""The FP4 (NVFP4 / MXFP4) decode GEMV on the tensor cores (1-4 rows), on kernels/quant/triton_fp4.py's
layout: kernels/quant/triton_w4a16_gemv.py's "mmak" design (its INT4 words, 8 runs a block, the
tile's columns being runs x rows, one product a run, its scales spread over the columns by a small
tensor-core product and applied to the runs' partial sums), with E2M1 decoding:

- Decoding, in PTX (`tl.inline_asm_elementwise`), two weights at a time: a `prmt` puts byte b of two
  consecutive words into the high bytes of a register's halves, so the byte's upper code sits at
  bits 12-15 of each half: its sign is already at bit 15, and one shift, one mask and one `lop3`
  move its three magnitude bits under the sign (bits 9-11 of an fp16: e2m1 * 2^-14; bits 6-8 of a
  bf16: e2m1 * 2^-126, which one packed multiply by 2^126 brings to e2m1 itself, as fp32 sums of
  products that small would lose bits); a shift by 4 first does the same for the lower code. Exact,
  no table: E2M1's subnormal 0.5 comes out as a subnormal fp16 / bf16 before that multiply.
- The scales: a run (16 inputs) lies in one scale group, so each run's fp32 partial sums are
  multiplied by its scale once a block (fp32, exact), as the INT4 GEMV's `fold_all` does: the
  block's 8 scale bytes decoded to bf16 (E4M3 and E8M0 both exact there) and spread over their
  runs' columns by a one-hot product. (Multiplying the decoded weights by their run's scale instead
  measured 2x slower on an H200: each run's scales took a trip through shared memory to reach the
  weights' register layout.) The fp32 sums take the row's global factor at the end.
- The programs: BLOCK_N output rows (16: the tensor cores' tile) and H blocks side by side on the
  batch axis of the products (one warp each), walking K H blocks a step; split-K (grid axis 1,
  kernels/quant/splitk.py) where the tiles ask for it (the tuned defaults do not: it did not pay on
  the 8B shapes); the gated form (gate_up, SiLU-and-mul) keeps
  both halves' sums. The next kernel launches after the loop's loads (kernels/pdl.py, late release).
"""
from __future__ import annotations

import torch

from shardserve.kernels import pdl
from shardserve.kernels.quant import splitk
from shardserve.kernels.quant.triton_fp4 import GROUP, decode, scale_of
from shardserve.utils import cdiv

MAX_ROWS = 4


try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    from shardserve.kernels.quant.triton_w4a16_gemv import pick

    @triton.jit
    def spread_scales(s_rows, blk, k, live, E, MX: tl.constexpr, GROUP: tl.constexpr):
        """[H, BLOCK_N, COLS] fp32: each column's run's scale, for the blocks blk [H] of the rows at
        s_rows [1, BLOCK_N, 1] (0 past K): the 8 scale bytes decoded to bf16 (exact) in a
        [H, BLOCK_N, 16] tile (columns 8 and up masked), times the one-hot E."""
        i = tl.arange(0, 16)
        k0 = blk[:, None, None] * 128 + 16 * i[None, None, :]
        ok = live & ((i < 8)[None, None, :] & (k0 < k))
        v = scale_of(s_rows, ok, k0, MX, GROUP)
        return tl.dot(tl.where(ok, v, 0.0).to(tl.bfloat16), E)   # (with the where: 86 registers; 104 without)

    @triton.jit
    def block_sum(y, w_rows, s_rows, X, it, blk, k, live, lanes, E, MX: tl.constexpr, GROUP: tl.constexpr,
                  BF16: tl.constexpr):
        """y plus the H blocks at `it` of the rows at w_rows, s_rows times X: one product a run,
        each column keeping its own run's sums, times that run's scale."""
        P = tl.load(w_rows + it * 16, mask=live, other=0, eviction_policy="evict_first")
        w0, w1, w2, w3, w4, w5, w6, w7 = decode(P, BF16)
        t = pick(tl.dot(w0, X), tl.dot(w1, X), tl.dot(w2, X), tl.dot(w3, X), tl.dot(w4, X), tl.dot(w5, X),
                 tl.dot(w6, X), tl.dot(w7, X), lanes[None, None, :])
        return y + spread_scales(s_rows, blk, k, live, E, MX, GROUP) * t

    @triton.jit
    def fold_rows(y, r_ptr, cols, col_ok, ROWS: tl.constexpr, BF16: tl.constexpr):
        """[BLOCK_N, ROWS] fp32 outputs: the H blocks and the runs summed per row, times the rows'
        global factor (and 2^14 undoing the fp16 decoding's 2^-14)."""
        t = tl.sum(y, axis=0)
        BLOCK_N: tl.constexpr = t.shape[0]
        COLS: tl.constexpr = t.shape[1]
        out = tl.sum(tl.reshape(t, [BLOCK_N, COLS // ROWS, ROWS]), axis=1)
        factor = tl.load(r_ptr + cols, mask=col_ok, other=0.0) * (1.0 if BF16 else 16384.0)
        return out * factor[:, None]

    @triton.jit
    def fp4_gemv_kernel(x_ptr, w_ptr, s_ptr, r_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, rows, n, k, words, stride_x,
                        stride_s, stride_o, MX: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_N: tl.constexpr, H: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                        GATED: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        COLS: tl.constexpr = 16 if 8 * ROWS < 16 else 8 * ROWS   # a tensor-core tile is 16 wide at least
        BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
        dt = tl.bfloat16 if BF16 else tl.float16
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        h = tl.arange(0, H)
        j = tl.arange(0, 16)
        c = tl.arange(0, COLS)
        lanes = c // ROWS                       # the run each column of X holds (8 and up: padding)
        c_row = c % ROWS
        x_k = (h * 128)[:, None, None] + (16 * lanes)[None, None, :] + j[None, :, None]    # [H, 16, COLS]
        x_cols = x_ptr + c_row[None, None, :] * stride_x + x_k
        x_ok = ((c_row < rows) & (lanes < 8))[None, None, :]
        w_j = (h * 16)[:, None, None] + j[None, None, :]                                    # [H, 1, 16]
        w_rows = w_ptr + cols[None, :, None].to(tl.int64) * words + w_j
        s_rows = s_ptr + cols[None, :, None].to(tl.int64) * stride_s
        w_up = w_ptr + (n + cols[None, :, None]).to(tl.int64) * words + w_j
        s_up = s_ptr + (n + cols[None, :, None]).to(tl.int64) * stride_s
        blocks = tl.cdiv(k, 128)
        per = tl.cdiv(blocks, SPLIT)
        first = tl.program_id(1) * per
        last = tl.minimum(first + per, blocks)
        i = tl.arange(0, 16)
        E = tl.broadcast_to((((i[:, None] == lanes[None, :]) & (i < 8)[:, None]).to(tl.bfloat16))[None, :, :],
                            [H, 16, COLS])   # run i -> its columns
        y = tl.zeros([H, BLOCK_N, COLS], tl.float32)
        y_up = tl.zeros([H, BLOCK_N, COLS], tl.float32)
        for it in range(first, last, H):
            blk = it + h
            live = col_ok[None, :, None] & (blk < last)[:, None, None]
            X = tl.load(x_cols + it * 128, mask=x_ok & (it * 128 + x_k < k) & (blk < last)[:, None, None],
                        other=0.0).to(dt)
            y = block_sum(y, w_rows, s_rows, X, it, blk, k, live, lanes, E, MX, GROUP, BF16)
            if GATED:
                y_up = block_sum(y_up, w_up, s_up, X, it, blk, k, live, lanes, E, MX, GROUP, BF16)
        pdl.release(PDL)
        y = fold_rows(y, r_ptr, cols, col_ok, ROWS, BF16)
        y_up = fold_rows(y_up, r_ptr, n + cols, col_ok, ROWS, BF16) if GATED else y   # (row_scale has n rows then)
        r = tl.arange(0, ROWS)
        splitk.reduce_and_finish(y, y_up, ws_ptr, cnt_ptr, n, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o,
                                 SPLIT, HAS_BIAS, GATED)


def tiles_for(n: int, gated: bool, rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, H, SPLIT, stages): the fastest of a sweep over Llama-3-8B's shapes on an H200
    (`benchmarks/quant_gemv.py --sweep`, BENCHMARKS.md session 35): 16 output rows and 4 blocks a
    step; at 1-2 rows, 8 blocks for layers of up to 4096 outputs, 32 rows for gate_up."""
    if rows > 2:
        return 16, 4, 1, 3
    if gated:
        return 32, 4, 1, 3
    return (16, 8, 1, 3) if n <= 4096 else (16, 4, 1, 3)


def gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor, kind: str, k: int,
         bias: torch.Tensor | None = None, gated: bool = False, tiles: tuple | None = None) -> torch.Tensor:
    """x [rows <= MAX_ROWS, K] (bf16 / fp16) against the FP4 weight [N, ...] (gated: [2 * n, ...],
    gate rows then up rows, result silu(gate) * up [rows, n])."""
    if gated and bias is not None:
        raise ValueError("the gated form takes no bias")
    rows = x.shape[0]
    n = words.shape[0] // 2 if gated else words.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_n, h, split, stages = tiles or tiles_for(n, gated, rows)
    padded = max(1, 1 << (rows - 1).bit_length())
    split = min(split, cdiv(k, 128 * h))
    grid = (cdiv(n, block_n), split)
    ws, counters = splitk.buffers(x.device, split * padded * 2 * n, grid[0])
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    fp4_gemv_kernel[grid](
        x, words, scales, row_scale, bias if bias is not None else row_scale, out, ws, counters, rows, n, k,
        words.shape[1], x.stride(0), scales.stride(0), out.stride(0), MX=kind == "mxfp4", GROUP=GROUP[kind],
        ROWS=padded, BLOCK_N=block_n, H=h, SPLIT=split, HAS_BIAS=bias is not None, GATED=gated, num_warps=h,
        num_stages=stages, **pdl.launch_args(x, late=True))
    return out
