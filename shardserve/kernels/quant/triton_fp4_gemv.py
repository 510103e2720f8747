"""The FP4 (NVFP4 / MXFP4) decode GEMV on the tensor cores (1-4 rows), on kernels/quant/triton_fp4.py's
layout: kernels/quant/triton_w4a16_gemv.py's design (its INT4 words, 8 runs a block, the tile's
columns being runs x rows, one accumulator a run, picked once at the end), with E2M1 decoding:

- Decoding, in PTX (`tl.inline_asm_elementwise`), two weights at a time: a `prmt` puts byte b of two
  consecutive words into the high bytes of a register's halves, so the byte's upper code sits at
  bits 12-15 of each half: its sign is already at bit 15, and one shift, one mask and one `lop3`
  move its three magnitude bits under the sign (bits 6-8 of a bf16: the value e2m1 * 2^-126, bits
  9-11 of an fp16: e2m1 * 2^-14); a shift by 4 first does the same for the lower code. Exact, no
  table: the e2m1 values that are subnormal in E2M1 (0.5) come out as subnormal bf16 / fp16 values.
- The scale: a run lies in one scale group, so one packed multiply of each decoded pair by its run's
  scale s' makes weights e2m1 * scale * 2^-7 exactly (at most 2 + 4 significant bits, in range): s'
  = scale * 2^119 for bf16 (e2m1 * 2^-126 * s'), scale * 2^7 for fp16. The fp32 sums are multiplied
  by 2^7 and the row's global factor at the end. MXFP4's power-of-two scales must keep s' and the
  products normal (`fits`); NVFP4's E4M3 scales always do.
- The programs: BLOCK_N output rows (16: the tensor cores' tile) and H blocks side by side on the
  batch axis of the products (one warp each), walking K H blocks a step; split-K (grid axis 1,
  kernels/quant/splitk.py) for layers with few outputs; the gated form (gate_up, SiLU-and-mul) keeps
  both halves' accumulators. The next kernel launches after the loop's loads (kernels/pdl.py, late).
"""
from __future__ import annotations

import torch

from shardserve.kernels import pdl
from shardserve.kernels.quant import splitk
from shardserve.kernels.quant.triton_fp4 import BLOCK, GROUP
from shardserve.utils import cdiv

MAX_ROWS = 4
SCALE_SHIFT = 7   # the decoded weights are e2m1 * scale * 2^-SCALE_SHIFT


def _unpack_asm(bf16: bool) -> str:
    """PTX: two words in ($8, $9: inputs 2v and 2v + 1 of each run), the runs' scale pairs in
    $10-$17; run i out in $i as a packed pair of weights times the scale."""
    shift, magnitude = (6, "0x01C001C0") if bf16 else (3, "0x0E000E00")
    lines = ["{ .reg .b32 t, u, v, z;", "mov.b32 z, 0x80008000;"]
    for b in range(4):
        select = b | b << 4 | (4 + b) << 8 | (4 + b) << 12    # byte b of $8, $9 into bytes 1 and 3
        lines += [f"prmt.b32 t, $8, $9, {select:#x};", "shl.b32 v, t, 4;"]
        for out, src in ((2 * b, "v"), (2 * b + 1, "t")):    # the lower code (nibble 2b), then the upper
            lines += [f"shr.u32 u, {src}, {shift};", f"and.b32 u, u, {magnitude};",
                      f"lop3.b32 ${out}, {src}, 0x80008000, u, 0xEA;"]   # (src & signs) | u
            lines.append(f"fma.rn.bf16x2 ${out}, ${out}, ${10 + out}, z;" if bf16
                         else f"mul.rn.f16x2 ${out}, ${out}, ${10 + out};")
    return "\n".join(lines + ["}"])


try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    from shardserve.kernels.quant.triton_w4a16_gemv import pick

    UNPACK_BF16 = tl.constexpr(_unpack_asm(True))
    UNPACK_FP16 = tl.constexpr(_unpack_asm(False))
    CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 10))

    @triton.jit
    def unpack(P, S0, S1, S2, S3, S4, S5, S6, S7, BF16: tl.constexpr):
        """The 8 runs of the words P [H, BLOCK_N, 16] as 8 tensors of weights times 2^-SCALE_SHIFT,
        each run multiplied by its scale tensor S0..S7 (P's shape, in the activations' dtype)."""
        if BF16:
            return tl.inline_asm_elementwise(UNPACK_BF16, CONSTRAINTS, [P, S0, S1, S2, S3, S4, S5, S6, S7],
                                             dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(UNPACK_FP16, CONSTRAINTS, [P, S0, S1, S2, S3, S4, S5, S6, S7],
                                             dtype=(tl.float16,) * 8, is_pure=True, pack=2)

    @triton.jit
    def run_scale(s_rows, blk, i: tl.constexpr, k, live, shape, MX: tl.constexpr, GROUP: tl.constexpr,
                  BF16: tl.constexpr):
        """s' of run i of the blocks blk [H] for the rows at s_rows [1, BLOCK_N, 1], broadcast to
        `shape` in the activations' dtype (0 past K)."""
        k0 = blk * 128 + 16 * i
        ok = live & (k0 < k)[:, None, None]
        s = tl.load(s_rows + (k0 // GROUP)[:, None, None], mask=ok, other=0).to(tl.int32)
        if MX:   # 2^(s - 127) * 2^119 (bf16) or * 2^7 (fp16), as an fp32's exponent field
            v = ((s + (119 if BF16 else 7)) << 23).to(tl.float32, bitcast=True)
            v = tl.where(ok, v, 0.0)
        else:    # E4M3 at bits 7-13 of an fp16 is e4m3 * 2^-8: times 2^127 (bf16) or 2^15 (fp16)
            e4m3 = (((s & 0x7F) << 7) | ((s & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
            v = e4m3.to(tl.float32) * (1.7014118346046923e38 if BF16 else 32768.0)
        return tl.broadcast_to(v.to(tl.bfloat16 if BF16 else tl.float16), shape)

    @triton.jit
    def block_products(a0, a1, a2, a3, a4, a5, a6, a7, w_rows, s_rows, X, it, blk, k, live, MX: tl.constexpr,
                       GROUP: tl.constexpr, BF16: tl.constexpr):
        """The accumulators plus the H blocks at `it` of the rows at w_rows, s_rows times X."""
        P = tl.load(w_rows + it * 16, mask=live, other=0, eviction_policy="evict_first")
        shape: tl.constexpr = P.shape
        w0, w1, w2, w3, w4, w5, w6, w7 = unpack(
            P, run_scale(s_rows, blk, 0, k, live, shape, MX, GROUP, BF16),
            run_scale(s_rows, blk, 1, k, live, shape, MX, GROUP, BF16),
            run_scale(s_rows, blk, 2, k, live, shape, MX, GROUP, BF16),
            run_scale(s_rows, blk, 3, k, live, shape, MX, GROUP, BF16),
            run_scale(s_rows, blk, 4, k, live, shape, MX, GROUP, BF16),
            run_scale(s_rows, blk, 5, k, live, shape, MX, GROUP, BF16),
            run_scale(s_rows, blk, 6, k, live, shape, MX, GROUP, BF16),
            run_scale(s_rows, blk, 7, k, live, shape, MX, GROUP, BF16), BF16)
        return (tl.dot(w0, X, a0), tl.dot(w1, X, a1), tl.dot(w2, X, a2), tl.dot(w3, X, a3),
                tl.dot(w4, X, a4), tl.dot(w5, X, a5), tl.dot(w6, X, a6), tl.dot(w7, X, a7))

    @triton.jit
    def fold_runs(a0, a1, a2, a3, a4, a5, a6, a7, lanes, r_ptr, cols, col_ok, ROWS: tl.constexpr):
        """[BLOCK_N, ROWS] fp32 outputs: each column's own run (pick), the H blocks and the runs summed
        per row, times 2^SCALE_SHIFT and the rows' global factor."""
        t = tl.sum(pick(a0, a1, a2, a3, a4, a5, a6, a7, lanes[None, None, :]), axis=0)
        BLOCK_N: tl.constexpr = t.shape[0]
        COLS: tl.constexpr = t.shape[1]
        out = tl.sum(tl.reshape(t, [BLOCK_N, COLS // ROWS, ROWS]), axis=1)
        return out * (tl.load(r_ptr + cols, mask=col_ok, other=0.0) * 128.0)[:, None]

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
        shape: tl.constexpr = [H, BLOCK_N, COLS]
        a0, a1, a2, a3 = tl.zeros(shape, tl.float32), tl.zeros(shape, tl.float32), tl.zeros(shape, tl.float32), \
            tl.zeros(shape, tl.float32)
        a4, a5, a6, a7 = tl.zeros(shape, tl.float32), tl.zeros(shape, tl.float32), tl.zeros(shape, tl.float32), \
            tl.zeros(shape, tl.float32)
        g0, g1, g2, g3 = tl.zeros(shape, tl.float32), tl.zeros(shape, tl.float32), tl.zeros(shape, tl.float32), \
            tl.zeros(shape, tl.float32)
        g4, g5, g6, g7 = tl.zeros(shape, tl.float32), tl.zeros(shape, tl.float32), tl.zeros(shape, tl.float32), \
            tl.zeros(shape, tl.float32)
        for it in range(first, last, H):
            blk = it + h
            live = col_ok[None, :, None] & (blk < last)[:, None, None]
            X = tl.load(x_cols + it * 128, mask=x_ok & (it * 128 + x_k < k) & (blk < last)[:, None, None],
                        other=0.0).to(dt)
            a0, a1, a2, a3, a4, a5, a6, a7 = block_products(a0, a1, a2, a3, a4, a5, a6, a7, w_rows, s_rows, X, it,
                                                            blk, k, live, MX, GROUP, BF16)
            if GATED:
                g0, g1, g2, g3, g4, g5, g6, g7 = block_products(g0, g1, g2, g3, g4, g5, g6, g7, w_up, s_up, X, it,
                                                                blk, k, live, MX, GROUP, BF16)
        pdl.release(PDL)
        y = fold_runs(a0, a1, a2, a3, a4, a5, a6, a7, lanes, r_ptr, cols, col_ok, ROWS)
        y_up = y
        if GATED:
            y_up = fold_runs(g0, g1, g2, g3, g4, g5, g6, g7, lanes, r_ptr, n + cols, col_ok, ROWS)
        r = tl.arange(0, ROWS)
        splitk.reduce_and_finish(y, y_up, ws_ptr, cnt_ptr, n, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o,
                                 SPLIT, HAS_BIAS, GATED)


def fits(scales: torch.Tensor, kind: str, dtype: torch.dtype) -> bool:
    """Whether the GEMV's decoded weights hold these scales exactly: always for NVFP4's E4M3; for
    MXFP4's exponents e (2^(e - 127)), s' and every product e2m1 * 2^(e - 134) must be normal in
    `dtype` (bf16: 9 <= e <= 135; fp16: 111 <= e <= 135; checkpoints' exponents sit near 127)."""
    if kind == "nvfp4":
        return True
    low = 9 if dtype == torch.bfloat16 else 111
    return scales.numel() == 0 or (int(scales.min()) >= low and int(scales.max()) <= 135)


def tiles_for(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, H, SPLIT, stages): 16 rows a program, 4 blocks a step; layers with few outputs
    split K so every SM gets programs."""
    split = 1 if n >= 8192 else max(1, min(4, 8192 // n))
    return 16, 4, min(split, max(1, cdiv(k, 4 * BLOCK))), 3


def gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor, kind: str, k: int,
         bias: torch.Tensor | None = None, gated: bool = False, tiles: tuple | None = None) -> torch.Tensor:
    """x [rows <= MAX_ROWS, K] (bf16 / fp16) against the FP4 weight [N, ...] (gated: [2 * n, ...],
    gate rows then up rows, result silu(gate) * up [rows, n])."""
    if gated and bias is not None:
        raise ValueError("the gated form takes no bias")
    rows = x.shape[0]
    n = words.shape[0] // 2 if gated else words.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_n, h, split, stages = tiles or tiles_for(n, k)
    padded = max(1, 1 << (rows - 1).bit_length())
    grid = (cdiv(n, block_n), split)
    ws, counters = splitk.buffers(x.device, split * padded * 2 * n, grid[0])
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    fp4_gemv_kernel[grid](
        x, words, scales, row_scale, bias if bias is not None else row_scale, out, ws, counters, rows, n, k,
        words.shape[1], x.stride(0), scales.stride(0), out.stride(0), MX=kind == "mxfp4", GROUP=GROUP[kind],
        ROWS=padded, BLOCK_N=block_n, H=h, SPLIT=split, HAS_BIAS=bias is not None, GATED=gated, num_warps=h,
        num_stages=stages, **pdl.launch_args(x, late=True))
    return out
