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
  only its own are kept (the scale times a one-hot mask), summed per row at the end. Wasted
  multiplies cost nothing here; shared-memory traffic would.
Split-K (grid axis 1, kernels/quant/splitk.py) gives small layers enough programs.
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
        return y + tl.where(lanes[None, :] == a, s[:, None], 0.0) * (acc - (z + MAGIC)[:, None] * xs)

    @triton.jit
    def block_sum(y, w_rows, x_cols, x_ok, s_ptr, z_ptr, blk, k, rows_total, cols, col_ok, lanes, x_k,
                  GROUP: tl.constexpr, RUN: tl.constexpr, STEP: tl.constexpr, MAGIC: tl.constexpr,
                  BF16: tl.constexpr):
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
                          PDL: tl.constexpr):
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
        w_rows = w_ptr + cols[:, None].to(tl.int64) * words + j[None, :]
        w_up = w_ptr + (n + cols[:, None]).to(tl.int64) * words + j[None, :]
        blocks = tl.cdiv(k, 8 * RUN)
        per = tl.cdiv(blocks, SPLIT)
        first = tl.program_id(1) * per
        last = tl.minimum(first + per, blocks)
        y = tl.zeros([BLOCK_N, COLS], tl.float32)
        y_up = tl.zeros([BLOCK_N, COLS], tl.float32)
        for blk in range(first, last):
            y = block_sum(y, w_rows, x_cols, x_ok, s_ptr, z_ptr, blk, k, rows_total, cols, col_ok, lanes, x_k,
                          GROUP, RUN, STEP, MAGIC, BF16)
            if GATED:
                y_up = block_sum(y_up, w_up, x_cols, x_ok, s_ptr, z_ptr, blk, k, rows_total, n + cols, col_ok, lanes,
                                 x_k, GROUP, RUN, STEP, MAGIC, BF16)
        # column c holds row c % ROWS: fold the runs
        out = tl.sum(tl.reshape(y, [BLOCK_N, COLS // ROWS, ROWS]), axis=1)
        out_up = tl.sum(tl.reshape(y_up, [BLOCK_N, COLS // ROWS, ROWS]), axis=1)
        r = tl.arange(0, ROWS)
        splitk.reduce_and_finish(out, out_up, ws_ptr, cnt_ptr, n, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o,
                                 SPLIT, HAS_BIAS, GATED)


def _tiles(x: torch.Tensor, n: int, k: int, gated: bool) -> tuple:
    """("mma", BLOCK_N, STEP, SPLIT, warps, stages), or ("fma", BLOCK_N, warps) where the tuned
    table found triton_w4a16.gemv_fma faster: tuned for this GPU and shape, else a default (16 rows
    a warp: the tensor-core tile's height)."""
    found = tuned.lookup("int4_mma", n, k, gated, x.shape[0], x.device)
    if found:
        return tuple(found)
    return ("mma", 32, 32, 1, 2, 3) if n >= 8192 else ("mma", 32, 32, 2, 2, 3)


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
    split = max(1, min(split, cdiv(k, 8 * run)))
    padded = max(1, 1 << (rows - 1).bit_length())
    grid = (cdiv(n, block_n), split)
    ws, counters = splitk.buffers(x.device, split * padded * 2 * n, grid[0])
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    w4a16_gemv_kernel[grid](
        x, words, scales, zeros, bias if bias is not None else scales, out, ws, counters, rows, n, k, words.shape[1],
        x.stride(0), out.stride(0), GROUP=group, RUN=run, ROWS=padded, BLOCK_N=block_n, STEP=step, SPLIT=split,
        HAS_BIAS=bias is not None, GATED=gated, num_warps=warps, num_stages=stages, **pdl.launch_args(x))
    return out
