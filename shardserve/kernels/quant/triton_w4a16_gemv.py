"""The W4A16 decode GEMV on the tensor cores (1-4 rows), on kernels/quant/int4_layout.py's layout.

At 4 bits an H100 must turn ~6e12 weights a second into products to keep up with its memory, about
five instructions per weight for the whole SM; the fp32 FMA kernel (triton_w4a16.gemv_fma) spends
four on each weight alone. Here:
- Unpacking: one `lop3` per int32 word makes two weights at once, (w & 0x000F000F) | 0x43004300
  read as a bf16 pair being (128 + q_a, 128 + q_b) exactly (0x6400: 1024 + q for fp16), and one
  packed fma subtracts (128 + z) from both: the exact integers q - z, as tensor-core operands
  (PTX through `tl.inline_asm_elementwise`). A word holds runs a and a + 4 of a block at nibbles
  a and a + 4, so a shift by 4a and one such step give two runs.
- The group scale multiplies the run's fp32 partial sums, not each weight: every run lies in one
  group, so sum_k (q_k - z) s x_k = s * sum_k (q_k - z) x_k.
- The activations: a tensor-core tile has at least 16 columns, and one row padded to 16 would move
  16x the activation bytes through shared memory. So the tile's columns are the block's 8 runs
  times the rows (column c = run c // ROWS, row c % ROWS): each run's product fills all columns and
  only its own are kept, summed per row at the end. Wasted multiplies cost nothing here;
  shared-memory traffic would.
- Scales and zeros (fp16 scales, the usual case; `fold_all`): once per block, one more small
  tensor-core product with a one-hot matrix E spreads each run's scale and zero over that run's
  columns (exact), then one select chain and s * (sum - (MAGIC + z) sum x) per accumulator element.
  Triton's pipeliner prefetches loads that feed a dot, so these loads now ride ahead with the
  words (session 16 loaded them per run, after the block's products, and waited on them). fp32
  scales keep the per-run `fold`.
- Two loops (the tiles' first field): "mma", one warp per 16 output rows walking each block's
  words STEP at a time; "mmak" (w4a16_gemvk_kernel, fp16 scales), the block's RUN // STEP chunks
  side by side on a batch axis of the products, one warp each, so a strip of outputs gets that
  many warps to hide its loads' latency (the parts summed once, at the end, in the program).
Split-K (grid axis 1, kernels/quant/splitk.py) gives small layers enough programs. Both loops let
the next kernel launch only after their loads (kernels/pdl.py, late release).
"""
from __future__ import annotations

import torch

from shardserve.kernels import pdl
from shardserve.kernels.quant import splitk, triton_w4a16, tuned
from shardserve.utils import cdiv

MAX_ROWS = 4



def _unpack_asm(magic: str) -> str:
    """PTX: two words in ($8, $9: consecutive inputs of each run), run i out in $i as a packed pair."""
    lines = ["{ .reg .b32 t, u;"]
    for b in range(4):   # byte b of both words side by side, its low nibbles under the magic, then its high ones
        lines += [f"prmt.b32 t, $8, $9, 0x0{4 + b}0{b};", f"lop3.b32 ${2 * b}, t, 0x000F000F, {magic}, 0xEA;",
                  "shr.u32 u, t, 4;", f"lop3.b32 ${2 * b + 1}, u, 0x000F000F, {magic}, 0xEA;"]
    return "\n".join(lines + ["}"])


try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    # Two words in ($8, $9: consecutive inputs of each run), run i out in $i: byte b of both words
    # side by side (prmt), its low nibbles under the magic exponent (lop3), then its high ones.
    UNPACK_BF16 = tl.constexpr(_unpack_asm("0x43004300"))
    UNPACK_FP16 = tl.constexpr(_unpack_asm("0x64006400"))

    @triton.jit
    def unpack(P, BF16: tl.constexpr):
        """The 8 runs of the words P [BLOCK_N, RUN] as 8 tensors of MAGIC + q (bf16: 128 + q, fp16:
        1024 + q), exact, at one instruction per weight."""
        if BF16:
            return tl.inline_asm_elementwise(UNPACK_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [P], dtype=(tl.bfloat16,) * 8,
                                             is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(UNPACK_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [P], dtype=(tl.float16,) * 8,
                                             is_pure=True, pack=2)

    @triton.jit
    def fold(y, acc, xs, a: tl.constexpr, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, lanes,
             GROUP: tl.constexpr, RUN: tl.constexpr, MAGIC: tl.constexpr):
        """y += run a of the block at k0 in its own columns: s * (sum_k (MAGIC + q_k) x_k - (MAGIC + z)
        sum_k x_k), acc and xs holding those sums (0 where the run starts past K). (Loading s and z
        before the block's dots instead measured slower on the H100: more registers.)"""
        g = (k0 + RUN * a) // GROUP
        ok = col_ok & (k0 + RUN * a < k)
        s = tl.load(s_ptr + g * rows_total + cols, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * rows_total + cols, mask=ok, other=0).to(tl.float32)
        if z_ptr.dtype.element_ty == tl.float16:   # mins: s (sum (MAGIC + q) x - MAGIC sum x) - m sum x
            return y + tl.where(lanes[None, :] == a, 1.0, 0.0) * (s[:, None] * (acc - MAGIC * xs) - z[:, None] * xs)
        return y + tl.where(lanes[None, :] == a, s[:, None], 0.0) * (acc - (z + MAGIC)[:, None] * xs)

    @triton.jit
    def spread(s_ptr, z_ptr, off, ok, E, MAGIC: tl.constexpr):
        """(S, MAGIC + Z) per accumulator element (fp16 "zeros", mins: (S, M)): the fp16 scales and
        zeros at off [..., 16] (column i: run i of the block; 8 and up masked) times the one-hot
        E [..., 16, COLS], exact."""
        s = tl.load(s_ptr + off, mask=ok, other=0.0)
        if z_ptr.dtype.element_ty == tl.float16:
            return tl.dot(s, E), tl.dot(tl.load(z_ptr + off, mask=ok, other=0.0), E)
        zm = (tl.load(z_ptr + off, mask=ok, other=0).to(tl.float16) + MAGIC).to(tl.float16)
        return tl.dot(s, E), tl.dot(zm, E)

    @triton.jit
    def apply_spread(y, S, ZM, t, xs, MINS: tl.constexpr, MAGIC: tl.constexpr):
        """y + the runs' sums t (of (MAGIC + q) x) and xs (of x) scaled: S (t - ZM xs) for zero
        points, S (t - MAGIC xs) - M xs for mins (spread's pair)."""
        if MINS:
            return y + S * (t - MAGIC * xs) - ZM * xs
        return y + S * (t - ZM * xs)

    @triton.jit
    def pick(a0, a1, a2, a3, a4, a5, a6, a7, sel):
        """Each column from the accumulator of its run (sel: the run of each column, broadcast)."""
        t = tl.where(sel == 1, a1, a0)
        t = tl.where(sel == 2, a2, t)
        t = tl.where(sel == 3, a3, t)
        t = tl.where(sel == 4, a4, t)
        t = tl.where(sel == 5, a5, t)
        t = tl.where(sel == 6, a6, t)
        return tl.where(sel == 7, a7, t)

    @triton.jit
    def fold_all(y, a0, a1, a2, a3, a4, a5, a6, a7, xs, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, lanes, E,
                 GROUP: tl.constexpr, RUN: tl.constexpr, MAGIC: tl.constexpr):
        """y += the block's 8 runs at once, fp16 scales: S [BLOCK_N, COLS] = s_tile @ E puts each
        column's run's scale in that column (E one-hot: E[i, c] = 1 where column c holds run i), and
        (MAGIC + z) likewise, exact on the tensor cores; loads that feed a dot are the ones Triton's
        pipeliner prefetches, so these no longer wait in the loop. Each column keeps its own run's
        sums (a select chain), then s * (sum (MAGIC + q) x - (MAGIC + z) sum x) once per element."""
        i = tl.arange(0, 16)
        g = (k0 + RUN * i) // GROUP
        ok = col_ok[:, None] & ((i < 8) & (k0 + RUN * i < k))[None, :]
        S, ZM = spread(s_ptr, z_ptr, g[None, :] * rows_total + cols[:, None], ok, E, MAGIC)
        t = pick(a0, a1, a2, a3, a4, a5, a6, a7, lanes[None, :])
        return apply_spread(y, S, ZM, t, xs, z_ptr.dtype.element_ty == tl.float16, MAGIC)

    @triton.jit
    def block_sum(y, w_rows, x_cols, x_ok, s_ptr, z_ptr, blk, k, rows_total, cols, col_ok, lanes, x_k, E,
                  GROUP: tl.constexpr, RUN: tl.constexpr, STEP: tl.constexpr, MAGIC: tl.constexpr,
                  BF16: tl.constexpr, SZ_DOT: tl.constexpr):
        """y += one block (8 runs of RUN inputs) of the weight rows at w_rows, STEP words at a time;
        each run's sums gather in their own accumulator (the tensor cores' adds), folded at the end."""
        k0 = blk * 8 * RUN
        dt = tl.bfloat16 if BF16 else tl.float16
        shape: tl.constexpr = y.shape
        a0 = tl.zeros(shape, tl.float32)
        a1 = tl.zeros(shape, tl.float32)
        a2 = tl.zeros(shape, tl.float32)
        a3 = tl.zeros(shape, tl.float32)
        a4 = tl.zeros(shape, tl.float32)
        a5 = tl.zeros(shape, tl.float32)
        a6 = tl.zeros(shape, tl.float32)
        a7 = tl.zeros(shape, tl.float32)
        xs = tl.zeros(shape, tl.float32)
        ones = tl.full([shape[0], STEP], 1.0, dt)
        for h in tl.static_range(RUN // STEP):
            P = tl.load(w_rows + blk * RUN + h * STEP, mask=col_ok[:, None], other=0, eviction_policy="evict_first")
            X = tl.load(x_cols + k0 + h * STEP, mask=x_ok & (k0 + h * STEP + x_k < k), other=0.0).to(dt)
            xs = tl.dot(ones, X, xs)   # every row: the columns' activation sums
            w0, w1, w2, w3, w4, w5, w6, w7 = unpack(P, BF16)
            a0 = tl.dot(w0, X, a0)
            a1 = tl.dot(w1, X, a1)
            a2 = tl.dot(w2, X, a2)
            a3 = tl.dot(w3, X, a3)
            a4 = tl.dot(w4, X, a4)
            a5 = tl.dot(w5, X, a5)
            a6 = tl.dot(w6, X, a6)
            a7 = tl.dot(w7, X, a7)
        if SZ_DOT:
            y = fold_all(y, a0, a1, a2, a3, a4, a5, a6, a7, xs, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok,
                         lanes, E, GROUP, RUN, MAGIC)
        else:
            y = fold(y, a0, xs, 0, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, lanes, GROUP, RUN, MAGIC)
            y = fold(y, a1, xs, 1, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, lanes, GROUP, RUN, MAGIC)
            y = fold(y, a2, xs, 2, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, lanes, GROUP, RUN, MAGIC)
            y = fold(y, a3, xs, 3, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, lanes, GROUP, RUN, MAGIC)
            y = fold(y, a4, xs, 4, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, lanes, GROUP, RUN, MAGIC)
            y = fold(y, a5, xs, 5, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, lanes, GROUP, RUN, MAGIC)
            y = fold(y, a6, xs, 6, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, lanes, GROUP, RUN, MAGIC)
            y = fold(y, a7, xs, 7, s_ptr, z_ptr, k0, k, rows_total, cols, col_ok, lanes, GROUP, RUN, MAGIC)
        return y

    @triton.jit
    def w4a16_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, rows, n, k, words, stride_x,
                          stride_o, GROUP: tl.constexpr, RUN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          STEP: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                          SZ_DOT: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        COLS: tl.constexpr = 16 if 8 * ROWS < 16 else 8 * ROWS   # a tensor-core tile is 16 wide at least
        BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
        MAGIC: tl.constexpr = 128.0 if BF16 else 1024.0
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        rows_total = 2 * n if GATED else n
        j = tl.arange(0, STEP)
        c = tl.arange(0, COLS)
        lanes = c // ROWS                       # the run each column of X holds (8 and up: padding)
        c_row = c % ROWS
        x_k = (RUN * lanes)[None, :] + j[:, None]                        # [STEP, COLS]: input - k0 - h * STEP
        x_cols = x_ptr + c_row[None, :] * stride_x + x_k
        x_ok = (c_row < rows)[None, :] & (lanes < 8)[None, :]
        i = tl.arange(0, 16)
        E = ((i[:, None] == lanes[None, :]) & (i < 8)[:, None]).to(tl.float16)   # [16, COLS]: run i -> its columns
        w_rows = w_ptr + cols[:, None].to(tl.int64) * words + j[None, :]
        w_up = w_ptr + (n + cols[:, None]).to(tl.int64) * words + j[None, :]
        blocks = tl.cdiv(k, 8 * RUN)
        per = tl.cdiv(blocks, SPLIT)
        first = tl.program_id(1) * per
        last = tl.minimum(first + per, blocks)
        y = tl.zeros([BLOCK_N, COLS], tl.float32)
        y_up = tl.zeros([BLOCK_N, COLS], tl.float32)
        for blk in range(first, last):
            y = block_sum(y, w_rows, x_cols, x_ok, s_ptr, z_ptr, blk, k, rows_total, cols, col_ok, lanes, x_k, E,
                          GROUP, RUN, STEP, MAGIC, BF16, SZ_DOT)
            if GATED:
                y_up = block_sum(y_up, w_up, x_cols, x_ok, s_ptr, z_ptr, blk, k, rows_total, n + cols, col_ok, lanes,
                                 x_k, E, GROUP, RUN, STEP, MAGIC, BF16, SZ_DOT)
        pdl.release(PDL)   # column c holds row c % ROWS: fold the runs
        out = tl.sum(tl.reshape(y, [BLOCK_N, COLS // ROWS, ROWS]), axis=1)
        out_up = tl.sum(tl.reshape(y_up, [BLOCK_N, COLS // ROWS, ROWS]), axis=1)
        r = tl.arange(0, ROWS)
        splitk.reduce_and_finish(out, out_up, ws_ptr, cnt_ptr, n, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o,
                                 SPLIT, HAS_BIAS, GATED)


    @triton.jit
    def block_sum3(y, w_rows, x_cols, x_ok, s_ptr, z_ptr, blk, k, rows_total, cols, col_ok, lanes, x_k, E, ones,
                   GROUP: tl.constexpr, RUN: tl.constexpr, MAGIC: tl.constexpr, BF16: tl.constexpr):
        """block_sum with the block's RUN // STEP chunks of words side by side on a batch axis (one
        warp each) instead of one after the other: y, the words [H, BLOCK_N, STEP] at w_rows and the
        activations [H, STEP, COLS] at x_cols all carry it; fp16 scales (fold_all's dot) only."""
        k0 = blk * 8 * RUN
        dt = tl.bfloat16 if BF16 else tl.float16
        P = tl.load(w_rows + blk * RUN, mask=col_ok[None, :, None], other=0, eviction_policy="evict_first")
        X = tl.load(x_cols + k0, mask=x_ok & (k0 + x_k < k), other=0.0).to(dt)
        xs = tl.dot(ones, X)
        w0, w1, w2, w3, w4, w5, w6, w7 = unpack(P, BF16)
        a0 = tl.dot(w0, X)
        a1 = tl.dot(w1, X)
        a2 = tl.dot(w2, X)
        a3 = tl.dot(w3, X)
        a4 = tl.dot(w4, X)
        a5 = tl.dot(w5, X)
        a6 = tl.dot(w6, X)
        a7 = tl.dot(w7, X)
        H: tl.constexpr = y.shape[0]
        i = tl.arange(0, 16)
        g = (k0 + RUN * i) // GROUP
        ok = (col_ok[None, :, None] & ((i < 8) & (k0 + RUN * i < k))[None, None, :]
              & (tl.arange(0, H) >= 0)[:, None, None])
        S, ZM = spread(s_ptr, z_ptr, g[None, None, :] * rows_total + cols[None, :, None], ok, E, MAGIC)
        t = pick(a0, a1, a2, a3, a4, a5, a6, a7, lanes[None, None, :])
        return apply_spread(y, S, ZM, t, xs, z_ptr.dtype.element_ty == tl.float16, MAGIC)

    @triton.jit
    def w4a16_gemvk_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, rows, n, k, words, stride_x,
                           stride_o, GROUP: tl.constexpr, RUN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                           STEP: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                           PDL: tl.constexpr):
        """w4a16_gemv_kernel with each block's RUN // STEP chunks on their own warps (the "mmak" loop,
        fp16 scales): a strip of outputs gets that many warps to hide its loads' latency."""
        pdl.start(PDL)
        H: tl.constexpr = RUN // STEP
        COLS: tl.constexpr = 16 if 8 * ROWS < 16 else 8 * ROWS
        BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
        MAGIC: tl.constexpr = 128.0 if BF16 else 1024.0
        dt = tl.bfloat16 if BF16 else tl.float16
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        rows_total = 2 * n if GATED else n
        h = tl.arange(0, H)
        j = tl.arange(0, STEP)
        c = tl.arange(0, COLS)
        lanes = c // ROWS
        c_row = c % ROWS
        x_k = (h * STEP)[:, None, None] + (RUN * lanes)[None, None, :] + j[None, :, None]    # [H, STEP, COLS]
        x_cols = x_ptr + c_row[None, None, :] * stride_x + x_k
        x_ok = ((c_row < rows) & (lanes < 8))[None, None, :]
        w_j = (h * STEP)[:, None, None] + j[None, None, :]                                    # [H, 1, STEP]
        w_rows = w_ptr + cols[None, :, None].to(tl.int64) * words + w_j
        w_up = w_ptr + (n + cols[None, :, None]).to(tl.int64) * words + w_j
        i = tl.arange(0, 16)
        E2 = ((i[:, None] == lanes[None, :]) & (i < 8)[:, None]).to(tl.float16)
        E = tl.broadcast_to(E2[None, :, :], [H, 16, COLS])
        ones = tl.full([H, BLOCK_N, STEP], 1.0, dt)
        blocks = tl.cdiv(k, 8 * RUN)
        per = tl.cdiv(blocks, SPLIT)
        first = tl.program_id(1) * per
        last = tl.minimum(first + per, blocks)
        y = tl.zeros([H, BLOCK_N, COLS], tl.float32)
        y_up = tl.zeros([H, BLOCK_N, COLS], tl.float32)
        for blk in range(first, last):
            y = block_sum3(y, w_rows, x_cols, x_ok, s_ptr, z_ptr, blk, k, rows_total, cols, col_ok, lanes, x_k, E,
                           ones, GROUP, RUN, MAGIC, BF16)
            if GATED:
                y_up = block_sum3(y_up, w_up, x_cols, x_ok, s_ptr, z_ptr, blk, k, rows_total, n + cols, col_ok, lanes,
                                  x_k, E, ones, GROUP, RUN, MAGIC, BF16)
        pdl.release(PDL)
        out = tl.sum(tl.reshape(tl.sum(y, axis=0), [BLOCK_N, COLS // ROWS, ROWS]), axis=1)
        out_up = tl.sum(tl.reshape(tl.sum(y_up, axis=0), [BLOCK_N, COLS // ROWS, ROWS]), axis=1)
        r = tl.arange(0, ROWS)
        splitk.reduce_and_finish(out, out_up, ws_ptr, cnt_ptr, n, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o,
                                 SPLIT, HAS_BIAS, GATED)


def _tiles(x: torch.Tensor, n: int, k: int, gated: bool) -> tuple:
    """("mma" | "mmak", BLOCK_N, STEP, SPLIT, warps, stages), or ("fma", BLOCK_N, warps) where the
    tuned table found triton_w4a16.gemv_fma faster: tuned for this GPU and shape, else a default.
    "mma": 16 output rows a warp (the tensor-core tile's height); "mmak": RUN // STEP warps a
    program, whatever the warps field says."""
    found = tuned.lookup("int4_mma", n, k, gated, x.shape[0], x.device)
    if found:
        return tuple(found)
    return "mmak", 16, 64, 1, 2, 3   # the fastest or near it on every 8B shape at 1 row (H100, session 17)


def gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, group: int,
         run: int, bias: torch.Tensor | None = None, gated: bool = False,
         tiles: tuple | None = None) -> torch.Tensor:
    """x [rows <= MAX_ROWS, K] against the kernel-layout weight [N, ...] (gated: [2 * n, ...], gate
    rows then up rows, result silu(gate) * up [rows, n]), bf16 or fp16 activations. The tuned
    table picks this kernel or the FMA one per shape and row count."""
    if gated and bias is not None:
        raise ValueError("the gated form takes no bias")
    rows = x.shape[0]
    n = words.shape[0] // 2 if gated else words.shape[0]
    loop, *tiles = tiles or _tiles(x, n, k, gated)
    if loop == "fma":
        return triton_w4a16.gemv_fma(x, words, scales, zeros, k, group, run, bias, gated, tiles=tuple(tiles))
    block_n, step, split, warps, stages = tiles
    step = min(step, run)
    if loop == "mmak" and scales.dtype != torch.float16:   # fp32 scales: the one-warp-per-strip loop
        loop, warps = "mma", max(1, block_n // 16)
    if loop not in ("mma", "mmak"):
        raise ValueError(f"unknown W4A16 GEMV loop {loop!r}: 'mma', 'mmak' or 'fma'")
    split = max(1, min(split, cdiv(k, 8 * run)))
    padded = max(1, 1 << (rows - 1).bit_length())
    grid = (cdiv(n, block_n), split)
    ws, counters = splitk.buffers(x.device, split * padded * 2 * n, grid[0])
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if loop == "mmak":
        w4a16_gemvk_kernel[grid](
            x, words, scales, zeros, bias if bias is not None else scales, out, ws, counters, rows, n, k,
            words.shape[1], x.stride(0), out.stride(0), GROUP=group, RUN=run, ROWS=padded, BLOCK_N=block_n, STEP=step,
            SPLIT=split, HAS_BIAS=bias is not None, GATED=gated, num_warps=run // step, num_stages=stages,
            **pdl.launch_args(x, late=True))
        return out
    w4a16_gemv_kernel[grid](
        x, words, scales, zeros, bias if bias is not None else scales, out, ws, counters, rows, n, k, words.shape[1],
        x.stride(0), out.stride(0), GROUP=group, RUN=run, ROWS=padded, BLOCK_N=block_n, STEP=step, SPLIT=split,
        HAS_BIAS=bias is not None, GATED=gated, SZ_DOT=scales.dtype == torch.float16,
        num_warps=warps, num_stages=stages, **pdl.launch_args(x, late=True))
    return out
