"""FP8 (E4M3) weights with a scale per output channel, times a few bf16/fp16 activation rows (a
decode batch, 1-16 rows), in Triton for CUDA; INT8 weights (quantization/int8.py) run the same loops.

As kernels/gemv/triton_gemv.py does for bf16: each program owns a strip of output features and
streams their weight rows once, start to end (no split-K, no partial sums in memory), at one byte
per weight. The weights are widened in registers (exact: every E4M3 value is an fp16, a bf16 and an
fp32) and the activations stay 16-bit (W8A16: no per-token FP8 rounding, no quantization kernel
before the matmul); the channel's scale multiplies the fp32 sum once, before the one rounding.
The inner loops (`tiles`' first field):
- "fma": fp32 multiply-adds on CUDA cores, loading the next K step before it works on the current
  one (the compiler pipelines only loads that feed a dot);
- "dot": the rows ride along as one tensor-core tile of 16, the weights widened to the activations'
  dtype;
- "dot16": the same in fp16, whose conversion from E4M3 is one instruction per two weights (bf16
  takes three); bf16 activations are clamped to fp16's range (+-65504) on the way.
- "runs" (fp8_runs_kernel, the default): tensor cores in fp16 too, without padding the activation
  tile from 1-4 rows to 16 (which moved 16x the activation bytes through shared memory, as many as
  the weights): a step's K range is cut into 8 runs and the tile's columns are runs x rows, so
  each run's product fills every column and keeps its own (kernels/quant/triton_w4a16_gemv.py
  does the same for INT4); split-K (kernels/quant/splitk.py) for layers with few output strips.
  "runs8" (fp8_runs8_kernel): one accumulator per run, kept over every step, so each product
  accumulates in the tensor cores and the columns are picked once, at the end (the runs loop picks
  them after every product); more registers, faster on the large layers.
  Both let the next kernel launch only after their loads (kernels/pdl.py, late release).
The gated form computes silu(x Wg^T) * (x Wu^T) for a stacked gate_up weight in the same pass.
Tile settings: kernels/quant/tuned.py.
"""
from __future__ import annotations

import torch

from shardserve.kernels import pdl
from shardserve.kernels.quant import splitk, tuned
from shardserve.utils import cdiv

MAX_ROWS = 16

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    @triton.jit
    def fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, rows, n, k, stride_x, stride_w, stride_o,
                        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, MODE: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)   # MODE 0: fma, 1: dot, 2: dot16 (the module docstring)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        col_ok = cols < n
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
        w_up = w_ptr + (n + cols[:, None]).to(tl.int64) * stride_w   # the up half's rows (gated)
        if MODE == 0:
            acc = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], tl.float32)
            k_ok = kk < k
            w = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if GATED:
                w_u = tl.load(w_up + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            for k0 in range(0, k, BLOCK_K):
                nxt_ok = col_ok[:, None] & (k0 + BLOCK_K + kk < k)[None, :]
                w_next = tl.load(w_rows + (k0 + BLOCK_K + kk)[None, :], mask=nxt_ok, other=0.0)
                if GATED:
                    w_u_next = tl.load(w_up + (k0 + BLOCK_K + kk)[None, :], mask=nxt_ok, other=0.0)
                x = tl.load(x_ptr + m[:, None] * stride_x + (k0 + kk)[None, :],
                            mask=(m[:, None] < rows) & (k0 + kk < k)[None, :], other=0.0).to(tl.float32)   # [M, K]
                acc += w.to(tl.float32)[:, None, :] * x[None, :, :]
                if GATED:
                    acc_up += w_u.to(tl.float32)[:, None, :] * x[None, :, :]
                w = w_next
                if GATED:
                    w_u = w_u_next
            y = tl.sum(acc, axis=2)
            y_up = tl.sum(acc_up, axis=2)
        else:
            y = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            y_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for k0 in range(0, k, BLOCK_K):
                k_ok = (k0 + kk) < k
                if EVEN_K:
                    w_ok = col_ok[:, None]
                else:
                    w_ok = col_ok[:, None] & k_ok[None, :]
                x = tl.load(x_ptr + m[None, :] * stride_x + (k0 + kk)[:, None],
                            mask=(m[None, :] < rows) & k_ok[:, None], other=0.0)                    # [K, M]
                if MODE == 2:
                    x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
                w = tl.load(w_rows + (k0 + kk)[None, :], mask=w_ok, other=0.0)
                y = tl.dot(w.to(x.dtype), x, y)
                if GATED:
                    w_u = tl.load(w_up + (k0 + kk)[None, :], mask=w_ok, other=0.0)
                    y_up = tl.dot(w_u.to(x.dtype), x, y_up)
        dt = out_ptr.dtype.element_ty
        y = y * tl.load(s_ptr + cols, mask=col_ok, other=0.0)[:, None]
        if HAS_BIAS:   # added in fp32 before the one rounding
            y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        y = y.to(dt)
        if GATED:   # as SiluAndMul on the rounded gate_up output: silu rounded, then the product
            g = y.to(tl.float32)
            sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            up = (y_up * tl.load(s_ptr + n + cols, mask=col_ok, other=0.0)[:, None]).to(dt).to(tl.float32)
            y = (sg * up).to(dt)
        ok = col_ok[:, None] & (m[None, :] < rows)
        tl.store(out_ptr + m[None, :] * stride_o + cols[:, None], y, mask=ok)

    # Four INT8 weights (one 32-bit register) to four fp16 (two): the sign bit flipped makes each byte
    # value + 128, placed under 0x64 as an fp16's low byte that is 1024 + value + 128 exactly, minus 1152.
    # Five instructions for four weights, where a plain conversion takes one or more per weight (INT8
    # decode was slower than bf16 with it).
    _INT8_TO_F16 = tl.constexpr("""{
    .reg .b32 t, k;
    xor.b32 t, $2, 0x80808080;
    prmt.b32 $0, t, 0x64646464, 0x4140;
    prmt.b32 $1, t, 0x64646464, 0x4342;
    mov.b32 k, 0x64806480;
    sub.f16x2 $0, $0, k;
    sub.f16x2 $1, $1, k;
    }""")

    @triton.jit
    def to_f16(w):
        """A weight tile in fp16: E4M3 converted by the hardware, INT8 by the byte trick above (exact)."""
        if w.dtype == tl.int8:
            return tl.inline_asm_elementwise(_INT8_TO_F16, "=r,=r,r", [w], dtype=tl.float16, is_pure=True, pack=4)
        return w.to(tl.float16)

    @triton.jit
    def run_tile(w_rows, ka, k, j, m):
        """The weight rows' C inputs at ka in fp16 (zero past k or outside the strip)."""
        return to_f16(tl.load(w_rows + ka, mask=m & (ka + j < k)[None, :], other=0.0, eviction_policy="evict_first"))

    @triton.jit
    def runs_step(y, w_rows, X, k0, k, col_ok, lanes, j, C: tl.constexpr, s_rows, BK: tl.constexpr):
        """y += the 8 runs of C inputs at k0 of the weight rows at w_rows against X [C, COLS] (fp16),
        each in its own accumulator, kept in its own columns. BK > 0: block scales (kernels/quant/
        triton_fp8_block.py), each run's product times its rows' scales for its block of BK inputs
        (s_rows: the rows' scale rows; C divides BK, so a run lies in one block)."""
        out = y
        for a in tl.static_range(8):
            ka = k0 + a * C
            part = tl.dot(run_tile(w_rows, ka, k, j, col_ok[:, None]), X)
            if BK > 0:
                part = part * tl.load(s_rows + tl.minimum(ka, k - 1) // BK, mask=col_ok, other=0.0)[:, None]
            out += tl.where(lanes[None, :] == a, part, 0.0)
        return out

    @triton.jit
    def block_scale_rows(s_ptr, srow_ptr, stride_s, cols, col_ok, n, GATED: tl.constexpr):
        """Block scales: the scale rows of the output rows `cols` (and of their up rows, n further)."""
        s_rows = s_ptr + tl.load(srow_ptr + cols, mask=col_ok, other=0) * stride_s
        s_up = s_rows
        if GATED:
            s_up = s_ptr + tl.load(srow_ptr + n + cols, mask=col_ok, other=0) * stride_s
        return s_rows, s_up

    @triton.jit
    def runs8_step(y0, y1, y2, y3, y4, y5, y6, y7, w_rows, X, k0, k, col_ok, j, C: tl.constexpr):
        """The 8 runs of C inputs at k0 against X, each into its own accumulator (kept over every
        step, its columns picked once at the end: no select per step)."""
        m = col_ok[:, None]
        y0 = tl.dot(run_tile(w_rows, k0, k, j, m), X, y0)
        y1 = tl.dot(run_tile(w_rows, k0 + C, k, j, m), X, y1)
        y2 = tl.dot(run_tile(w_rows, k0 + 2 * C, k, j, m), X, y2)
        y3 = tl.dot(run_tile(w_rows, k0 + 3 * C, k, j, m), X, y3)
        y4 = tl.dot(run_tile(w_rows, k0 + 4 * C, k, j, m), X, y4)
        y5 = tl.dot(run_tile(w_rows, k0 + 5 * C, k, j, m), X, y5)
        y6 = tl.dot(run_tile(w_rows, k0 + 6 * C, k, j, m), X, y6)
        y7 = tl.dot(run_tile(w_rows, k0 + 7 * C, k, j, m), X, y7)
        return y0, y1, y2, y3, y4, y5, y6, y7

    @triton.jit
    def pick_runs(y0, y1, y2, y3, y4, y5, y6, y7, lanes):
        """Column c of the result from accumulator lanes[c] (padding columns: y0's, whose X column is 0)."""
        t = tl.where(lanes[None, :] == 1, y1, y0)
        t = tl.where(lanes[None, :] == 2, y2, t)
        t = tl.where(lanes[None, :] == 3, y3, t)
        t = tl.where(lanes[None, :] == 4, y4, t)
        t = tl.where(lanes[None, :] == 5, y5, t)
        t = tl.where(lanes[None, :] == 6, y6, t)
        return tl.where(lanes[None, :] == 7, y7, t)

    @triton.jit
    def fp8_runs8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, rows, n, k, stride_x, stride_w,
                         stride_o, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, C: tl.constexpr, SPLIT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
        """fp8_runs_kernel with one accumulator per run (the "runs8" loop)."""
        pdl.start(PDL)
        COLS: tl.constexpr = 16 if 8 * ROWS < 16 else 8 * ROWS
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        j = tl.arange(0, C)
        c = tl.arange(0, COLS)
        lanes = c // ROWS
        c_row = c % ROWS
        x_k = (C * lanes)[None, :] + j[:, None]
        x_cols = x_ptr + c_row[None, :] * stride_x + x_k
        x_ok = (c_row < rows)[None, :] & (lanes < 8)[None, :]
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w + j[None, :]
        w_up = w_ptr + (n + cols[:, None]).to(tl.int64) * stride_w + j[None, :]
        steps = tl.cdiv(k, 8 * C)
        per = tl.cdiv(steps, SPLIT)
        first = tl.program_id(1) * per
        last = tl.minimum(first + per, steps)
        z = tl.zeros([BLOCK_N, COLS], tl.float32)
        y0, y1, y2, y3, y4, y5, y6, y7 = z, z, z, z, z, z, z, z
        u0, u1, u2, u3, u4, u5, u6, u7 = z, z, z, z, z, z, z, z
        for st in range(first, last):
            k0 = st * 8 * C
            X = tl.load(x_cols + k0, mask=x_ok & (k0 + x_k < k), other=0.0)
            X = tl.clamp(X.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
            y0, y1, y2, y3, y4, y5, y6, y7 = runs8_step(y0, y1, y2, y3, y4, y5, y6, y7, w_rows, X, k0, k, col_ok, j, C)
            if GATED:
                u0, u1, u2, u3, u4, u5, u6, u7 = runs8_step(u0, u1, u2, u3, u4, u5, u6, u7, w_up, X, k0, k, col_ok,
                                                            j, C)
        pdl.release(PDL)
        r = tl.arange(0, ROWS)
        y = tl.sum(tl.reshape(pick_runs(y0, y1, y2, y3, y4, y5, y6, y7, lanes), [BLOCK_N, COLS // ROWS, ROWS]), axis=1)
        y = y * tl.load(s_ptr + cols, mask=col_ok, other=0.0)[:, None]
        y_up = tl.sum(tl.reshape(pick_runs(u0, u1, u2, u3, u4, u5, u6, u7, lanes), [BLOCK_N, COLS // ROWS, ROWS]),
                      axis=1)
        if GATED:
            y_up = y_up * tl.load(s_ptr + n + cols, mask=col_ok, other=0.0)[:, None]
        splitk.reduce_and_finish(y, y_up, ws_ptr, cnt_ptr, n, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o,
                                 SPLIT, HAS_BIAS, GATED)

    @triton.jit
    def fp8_runs_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, rows, n, k, stride_x, stride_w, stride_o,
                        srow_ptr, stride_s, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, C: tl.constexpr,
                        SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BK: tl.constexpr,
                        PDL: tl.constexpr):
        """BK 0: a scale per output row, s_ptr [N]; BK > 0: block scales of BK inputs, s_ptr the scale
        rows [R, ceil(K / BK)] and srow_ptr [N] each output row's (kernels/quant/triton_fp8_block.py)."""
        pdl.start(PDL)
        COLS: tl.constexpr = 16 if 8 * ROWS < 16 else 8 * ROWS   # a tensor-core tile is 16 wide at least
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        j = tl.arange(0, C)
        c = tl.arange(0, COLS)
        lanes = c // ROWS                    # column c: run c // ROWS (8 and up: padding), row c % ROWS
        c_row = c % ROWS
        x_k = (C * lanes)[None, :] + j[:, None]                          # [C, COLS]: input - k0
        x_cols = x_ptr + c_row[None, :] * stride_x + x_k
        x_ok = (c_row < rows)[None, :] & (lanes < 8)[None, :]
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w + j[None, :]
        w_up = w_ptr + (n + cols[:, None]).to(tl.int64) * stride_w + j[None, :]
        s_rows, s_up = s_ptr, s_ptr   # (unused without block scales)
        if BK > 0:
            s_rows, s_up = block_scale_rows(s_ptr, srow_ptr, stride_s, cols, col_ok, n, GATED)
        steps = tl.cdiv(k, 8 * C)
        per = tl.cdiv(steps, SPLIT)
        first = tl.program_id(1) * per
        last = tl.minimum(first + per, steps)
        y = tl.zeros([BLOCK_N, COLS], tl.float32)
        y_up = tl.zeros([BLOCK_N, COLS], tl.float32)
        for st in range(first, last):
            k0 = st * 8 * C
            X = tl.load(x_cols + k0, mask=x_ok & (k0 + x_k < k), other=0.0)
            X = tl.clamp(X.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
            y = runs_step(y, w_rows, X, k0, k, col_ok, lanes, j, C, s_rows, BK)
            if GATED:
                y_up = runs_step(y_up, w_up, X, k0, k, col_ok, lanes, j, C, s_up, BK)
        pdl.release(PDL)
        r = tl.arange(0, ROWS)
        y = tl.sum(tl.reshape(y, [BLOCK_N, COLS // ROWS, ROWS]), axis=1)
        y_up = tl.sum(tl.reshape(y_up, [BLOCK_N, COLS // ROWS, ROWS]), axis=1)
        if BK == 0:
            y = y * tl.load(s_ptr + cols, mask=col_ok, other=0.0)[:, None]
            if GATED:
                y_up = y_up * tl.load(s_ptr + n + cols, mask=col_ok, other=0.0)[:, None]
        splitk.reduce_and_finish(y, y_up, ws_ptr, cnt_ptr, n, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o,
                                 SPLIT, HAS_BIAS, GATED)


MODES = {"fma": 0, "dot": 1, "dot16": 2}
# E4M3, or INT8 (compressed-tensors W8A8, quantization/int8.py): both widen exactly to fp16 in
# registers, so the same loops and the FP8 tile settings (the same bytes per weight) serve both.
WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.int8)
RUNS_ROWS = 4   # the "runs" loop: up to 4 rows (32 columns)


def handles(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """A CUDA bf16/fp16 activation of 1-16 rows against a contiguous E4M3 or INT8 weight, unless this GPU's
    tuned settings say `torch._scaled_mm` was faster for this shape and row count."""
    if not (tuned.ENABLED and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1
            and weight.dtype in WEIGHT_DTYPES and weight.is_contiguous()):
        return False
    if weight.dtype == torch.int8:   # (INT8 has no `_scaled_mm` to prefer)
        return True
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return tuned.lookup("fp8", n, weight.shape[1], gated, x.shape[0], x.device) != ["scaled_mm"]


def _tiles(x: torch.Tensor, n: int, k: int, gated: bool) -> tuple:
    """(loop, BLOCK_N, BLOCK_K, warps, stages), or for "runs" / "runs8" (loop, BLOCK_N, run length,
    warps, stages, SPLIT): tuned for this GPU and shape, else a default."""
    found = tuned.lookup("fp8", n, k, gated, x.shape[0], x.device)
    if found and found != ["scaled_mm"]:
        return tuple(found)
    if x.shape[0] <= RUNS_ROWS:   # 16 rows a warp: the tensor-core tile's height
        return "runs", 32, 64, 2, 3, 1 if n >= 8192 else 2
    return "dot16", 32, 256 if gated else 512, 4, 4   # the fastest or near it on every 8B shape (H100)


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
         gated: bool = False, tiles: tuple | None = None) -> torch.Tensor:
    """x [rows, K] @ (weight [N, K] * scale[:, None])^T (+ bias), scale fp32 [N]; gated: weight and
    scale stack gate then up rows ([2 * n, K], [2 * n]) and the result is silu(gate) * up [rows, n]."""
    if gated and bias is not None:
        raise ValueError("the gated form takes no bias")
    rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    loop, block_n, block_k, warps, stages, *split = tiles or _tiles(x, n, k, gated)
    if loop in ("runs", "runs8"):
        return runs(x, weight, scale, bias, gated, n, block_n, block_k, warps, stages, split[0] if split else 1, loop)
    block_m = max(1, 1 << (rows - 1).bit_length()) if loop == "fma" else MAX_ROWS
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    fp8_gemv_kernel[(cdiv(n, block_n),)](
        x, weight, scale, bias if bias is not None else scale, out, rows, n, k, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, GATED=gated, MODE=MODES[loop], EVEN_K=k % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, **pdl.launch_args(x))
    return out


def runs(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, gated: bool, n: int,
         block_n: int, run: int, warps: int, stages: int, split: int, loop: str = "runs",
         scale_row: torch.Tensor | None = None, block_k: int = 0) -> torch.Tensor:
    """The "runs" / "runs8" loops; block_k > 0 (the runs loop): block scales, `scale` the scale rows
    and `scale_row` each output row's (kernels/quant/triton_fp8_block.py)."""
    rows, k = x.shape
    if rows > RUNS_ROWS:
        raise ValueError(f"the runs loop takes up to {RUNS_ROWS} rows, not {rows}")
    split = max(1, min(split, cdiv(k, 8 * run)))
    padded = max(1, 1 << (rows - 1).bit_length())
    grid = (cdiv(n, block_n), split)
    ws, counters = splitk.buffers(x.device, split * padded * 2 * n, grid[0])
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    args = (x, weight, scale, bias if bias is not None else scale, out, ws, counters, rows, n, k, x.stride(0),
            weight.stride(0), out.stride(0))
    kw = dict(ROWS=padded, BLOCK_N=block_n, C=run, SPLIT=split, HAS_BIAS=bias is not None, GATED=gated,
              num_warps=warps, num_stages=stages, **pdl.launch_args(x, late=True))
    if loop == "runs8":
        assert not block_k, "the runs8 loop takes no block scales"
        fp8_runs8_kernel[grid](*args, **kw)
    elif block_k:
        fp8_runs_kernel[grid](*args, scale_row, scale.stride(0), BK=block_k, **kw)
    else:
        fp8_runs_kernel[grid](*args, scale, 0, BK=0, **kw)
    return out
