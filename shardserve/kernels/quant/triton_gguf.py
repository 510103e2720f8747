"""GGUF-quantized matmuls in Triton for CUDA: the weight stays in its blocks (regrouped into planes
by kernels/quant/gguf_layout.py) and is dequantized in registers inside the matmul.

A loop step takes NU "units" of each output row's quants: a unit is UB quant bytes whose two
halves (the low and high nibbles; Q8_0's two runs of 16 bytes) are two runs of UB inputs, each
inside one block of the format's scales: value j and j + 16 of a block of 32 (Q4_0, Q4_1, Q8_0),
j and j + 32 of 64 (Q4_K, Q5_K), j and j + 64 of 128 in runs of 16 (Q6_K, whose scales cover 16).
So the file's quants need no reordering: `_units` returns both halves as small integers
[NU, BLOCK_N, UB] with the inputs they hold, and per unit, row and half a scale s and an offset m
(the weight is s q + m: Q4_0 m = -8 s, Q4_1 the block's min, Q4_K / Q5_K -dmin mn with s = d sc,
Q6_K m = -32 s, Q8_0 none). The integers are exact in bf16, so

    sum over a half (s q + m) x  =  s (q . x) + m (sum of x),

where q . x is one batched tensor-core product per half over all NU units [NU, BLOCK_N, UB] x
[NU, UB, 16] with fp32 accumulation, and the scales apply once per unit, row and activation row
(not per weight). The weight loads feed the products, so Triton's pipeliner keeps them in flight.

- `gemv` (1-16 rows, decode): each program owns a strip of output rows, the activation rows padded
  to one 16-row tile (fp32 activations: products in full fp32, `input_precision="ieee"`); LOOP 0
  makes one batched product per half and step, LOOP 1 one plain product per unit and half;
  `gemv_cols_kernel` (loop 2, up to COLS_ROWS rows) puts a step's 16 scale blocks on the product's
  columns instead. Measured on an H100 (8B shapes, one row) they run at 0.3-1.0 TB/s of the
  weight's bytes, about half the bf16 GEMV's speed: the unpacking, not the memory, bounds them.
- `dequantize`: the weight as bf16/fp16 [n, K] (s q + m in fp32, rounded once), for cuBLAS on more
  rows (prefill).
kernels/quant/gguf_matmul.py picks between these and the W4A16 kernels (Q4_0) per run of rows.
Each kernel begins with `pdl.start(PDL)` (kernels/pdl.py); `gemv` lets the next kernel launch after
its main loop. Under TRITON_INTERPRET=1 they run on CPU tensors (the CPU tests do that).
"""
from __future__ import annotations

import torch

from shardserve.kernels import pdl
from shardserve.kernels.quant.gguf_layout import GgufPlanes
from shardserve.utils import cdiv

GEMV_ROWS = 16   # rows up to this: the tensor-core GEMV; more: dequantize, then cuBLAS
COLS_ROWS = 4    # rows up to this may take the block-columns loop (`gemv_cols_kernel`; its default: 1 row)
TYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}
VALUES_PER_UNIT = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 64, "Q5_K": 64, "Q6_K": 32}
STEP_VALUES = 256   # inputs per loop step by default: one K-quant super-block

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    @triton.jit
    def _units(q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, cols, col_ok, k0, u0, k, TYPE: tl.constexpr,
               NU: tl.constexpr):
        """Units u0 .. u0 + NU of the step at input k0 (the module docstring): the quants of both halves
        (int32 [NU, BLOCK_N, UB]), their scales and offsets (fp32 [NU, BLOCK_N, 1]), the inputs
        each half holds ([NU, UB]) and which units lie inside K ([NU])."""
        UB: tl.constexpr = 32 if TYPE == 3 or TYPE == 4 else 16
        u = u0 + tl.arange(0, NU)
        lane = tl.arange(0, UB)[None, :]
        rows = cols.to(tl.int64)[None, :, None]
        if TYPE <= 2:      # a unit: one block of 32, values j and j + 16
            first = k0 + 32 * u
            v_lo = first[:, None] + lane
            v_hi = v_lo + 16
        elif TYPE <= 4:    # a unit: 64 values, j and j + 32 (two blocks of 32)
            first = k0 + 64 * u
            v_lo = first[:, None] + lane
            v_hi = v_lo + 32
        else:              # a unit: 16 bytes of a 128-value half, values j and j + 64
            first = k0 + (u // 4) * 128 + 16 * (u % 4)
            v_lo = first[:, None] + lane
            v_hi = v_lo + 64
        u_ok = first < k
        ok = u_ok[:, None, None] & col_ok[None, :, None]          # [NU, BLOCK_N, 1]
        full = ok & (lane[:, None, :] >= 0)                        # [NU, BLOCK_N, UB]
        if TYPE == 2:      # Q8_0: int8 quants, s per 32, no offset
            q_lo = tl.load(q_ptr + rows * k + v_lo[:, None, :], mask=full, other=0).to(tl.int32)
            q_hi = tl.load(q_ptr + rows * k + v_hi[:, None, :], mask=full, other=0).to(tl.int32)
            s = tl.load(s_ptr + rows * (k // 32) + (first // 32)[:, None, None], mask=ok, other=0.0).to(tl.float32)
            return q_lo, q_hi, s, s, s * 0.0, s * 0.0, v_lo, v_hi, u_ok
        if TYPE <= 1:
            byte_at = k0 // 2 + 16 * u
        elif TYPE <= 4:
            byte_at = k0 // 2 + 32 * u
        else:
            byte_at = k0 // 2 + 16 * u
        byte = tl.load(q_ptr + rows * (k // 2) + (byte_at[:, None] + lane)[:, None, :], mask=full,
                       other=0).to(tl.int32)
        q_lo = byte & 15
        q_hi = byte >> 4
        if TYPE <= 1:      # Q4_0: s (q - 8); Q4_1: s q + min
            s = tl.load(s_ptr + rows * (k // 32) + (first // 32)[:, None, None], mask=ok, other=0.0).to(tl.float32)
            if TYPE == 0:
                m = -8.0 * s
            else:
                m = tl.load(m_ptr + rows * (k // 32) + (first // 32)[:, None, None], mask=ok,
                            other=0.0).to(tl.float32)
            return q_lo, q_hi, s, s, m, m, v_lo, v_hi, u_ok
        d = tl.load(d_ptr + rows * (k // 256) + (first // 256)[:, None, None], mask=ok, other=0.0).to(tl.float32)
        if TYPE == 5:      # Q6_K: 2 high bits (byte j of 32 per half, pair by quarter), int8 scale per 16
            h_at = k0 // 4 + (u // 4) * 32 + 16 * (u % 2)
            hb = tl.load(h_ptr + rows * (k // 4) + (h_at[:, None] + lane)[:, None, :], mask=full,
                         other=0).to(tl.int32)
            shift = (2 * ((u % 4) // 2))[:, None, None]
            q_lo = q_lo | (((hb >> shift) & 3) << 4)
            q_hi = q_hi | (((hb >> (shift + 4)) & 3) << 4)
            sc_at = k0 // 16 + (u // 4) * 8 + u % 4
            s_lo = d * tl.load(s_ptr + rows * (k // 16) + sc_at[:, None, None], mask=ok, other=0).to(tl.float32)
            s_hi = d * tl.load(s_ptr + rows * (k // 16) + (sc_at + 4)[:, None, None], mask=ok,
                               other=0).to(tl.float32)
            return q_lo, q_hi, s_lo, s_hi, -32.0 * s_lo, -32.0 * s_hi, v_lo, v_hi, u_ok
        if TYPE == 4:      # Q5_K: 1 high bit, byte j of 32 per super-block, bit by block of 32
            hb = tl.load(h_ptr + rows * (k // 8) + ((first // 256) * 32)[:, None, None] + lane[:, None, :],
                         mask=full, other=0).to(tl.int32)
            bit = ((first % 256) // 32)[:, None, None]
            q_lo = q_lo | (((hb >> bit) & 1) << 4)
            q_hi = q_hi | (((hb >> (bit + 1)) & 1) << 4)
        # Q4_K, Q5_K: per block of 32 a 6-bit scale and min (bytes in the planes): (d sc) q - dmin mn
        dm = tl.load(dm_ptr + rows * (k // 256) + (first // 256)[:, None, None], mask=ok, other=0.0).to(tl.float32)
        blk = rows * (k // 32) + (first // 32)[:, None, None]
        s_lo = d * tl.load(s_ptr + blk, mask=ok, other=0).to(tl.float32)
        s_hi = d * tl.load(s_ptr + blk + 1, mask=ok, other=0).to(tl.float32)
        m_lo = -dm * tl.load(m_ptr + blk, mask=ok, other=0).to(tl.float32)
        m_hi = -dm * tl.load(m_ptr + blk + 1, mask=ok, other=0).to(tl.float32)
        return q_lo, q_hi, s_lo, s_hi, m_lo, m_hi, v_lo, v_hi, u_ok

    @triton.jit
    def _half(q, s, m, x, IEEE: tl.constexpr, OFFSET: tl.constexpr, AXIS: tl.constexpr):
        """One half's share, s (q . x) + m (sum of x): batched, [NU, BLOCK_N, UB] x [NU, UB, BLOCK_M]
        (x's inputs on AXIS 1), or one unit, [BLOCK_N, UB] x [UB, BLOCK_M] (AXIS 0)."""
        if IEEE:
            p = tl.dot(q.to(tl.float32), x, input_precision="ieee")
        else:
            p = tl.dot(q.to(x.dtype), x)
        p = s * p
        if OFFSET:
            p += m * tl.expand_dims(tl.sum(x.to(tl.float32), axis=AXIS), AXIS)
        return p

    @triton.jit
    def gemv_kernel(x_ptr, q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, out_ptr, rows, n, k, stride_x,
                    stride_o, TYPE: tl.constexpr, NU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    LOOP: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        r = tl.arange(0, BLOCK_M)
        r_ok = r < rows
        step = NU * (64 if TYPE == 3 or TYPE == 4 else 32)
        UB: tl.constexpr = 32 if TYPE == 3 or TYPE == 4 else 16
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, k, step):
            if LOOP == 0:   # all units in one batched product per half
                q_lo, q_hi, s_lo, s_hi, m_lo, m_hi, v_lo, v_hi, u_ok = _units(
                    q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, cols, col_ok, k0, 0, k, TYPE, NU)
                x_mask = u_ok[:, None, None] & r_ok[None, None, :]
                x_lo = tl.load(x_ptr + r[None, None, :] * stride_x + v_lo[:, :, None], mask=x_mask, other=0.0)
                x_hi = tl.load(x_ptr + r[None, None, :] * stride_x + v_hi[:, :, None], mask=x_mask, other=0.0)
                part = (_half(q_lo, s_lo, m_lo, x_lo, IEEE, TYPE != 2, 1)
                        + _half(q_hi, s_hi, m_hi, x_hi, IEEE, TYPE != 2, 1))
                acc += tl.sum(part, axis=0)
            else:           # one plain product per unit and half
                for u in tl.static_range(NU):
                    q_lo, q_hi, s_lo, s_hi, m_lo, m_hi, v_lo, v_hi, u_ok = _units(
                        q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, cols, col_ok, k0, u, k, TYPE, 1)
                    x_mask = u_ok[:, None] & r_ok[None, :]
                    x_lo = tl.load(x_ptr + r[None, :] * stride_x + tl.reshape(v_lo, [UB])[:, None], mask=x_mask,
                                   other=0.0)
                    x_hi = tl.load(x_ptr + r[None, :] * stride_x + tl.reshape(v_hi, [UB])[:, None], mask=x_mask,
                                   other=0.0)
                    acc += _half(tl.reshape(q_lo, [BLOCK_N, UB]), tl.reshape(s_lo, [BLOCK_N, 1]),
                                 tl.reshape(m_lo, [BLOCK_N, 1]), x_lo, IEEE, TYPE != 2, 0)
                    acc += _half(tl.reshape(q_hi, [BLOCK_N, UB]), tl.reshape(s_hi, [BLOCK_N, 1]),
                                 tl.reshape(m_hi, [BLOCK_N, 1]), x_hi, IEEE, TYPE != 2, 0)
        pdl.release(PDL)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + r[None, :] * stride_o + cols[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=col_ok[:, None] & r_ok[None, :])

    @triton.jit
    def _block_cols(q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, cols, col_ok, k0, k, j, R: tl.constexpr,
                    TYPE: tl.constexpr):
        """One step of `gemv_cols_kernel` (16 scale blocks from input k0): the integer quants of both
        halves of each byte [BLOCK_N, HALF] (Q4_0 and Q6_K with their offsets, -8 / -32, folded in),
        the input each holds and the block (0-15) it lies in [HALF], and per output column j
        (block j // R, activation row j % R) the scale and min of rows `cols` [BLOCK_N, 16 R]."""
        HALF: tl.constexpr = 128 if TYPE == 5 else 256
        i = tl.arange(0, HALF)
        rows = cols.to(tl.int64)[:, None]
        if TYPE <= 2:      # 16 blocks of 32: byte j of a block holds values j and j + 16
            e_lo = (i // 16) * 32 + i % 16
            e_hi = e_lo + 16
            c_lo = i // 16
            c_hi = c_lo
        elif TYPE <= 4:    # 8 units of 64: byte l holds value l (block 2u) and l + 32 (block 2u + 1)
            e_lo = (i // 32) * 64 + i % 32
            e_hi = e_lo + 32
            c_lo = 2 * (i // 32)
            c_hi = c_lo + 1
        else:              # Q6_K, 16 blocks of 16: 16-byte unit u of a 128-value half, values +0 / +64
            u = i // 16
            e_lo = (u // 4) * 128 + 16 * (u % 4) + i % 16
            e_hi = e_lo + 64
            c_lo = (u // 4) * 8 + u % 4
            c_hi = c_lo + 4
        ok = col_ok[:, None] & ((k0 + e_lo) < k)[None, :]
        if TYPE == 2:
            q_lo = tl.load(q_ptr + rows * k + (k0 + e_lo)[None, :], mask=ok, other=0).to(tl.int32)
            q_hi = tl.load(q_ptr + rows * k + (k0 + e_hi)[None, :], mask=ok, other=0).to(tl.int32)
        else:
            byte = tl.load(q_ptr + rows * (k // 2) + (k0 // 2 + i)[None, :], mask=ok, other=0).to(tl.int32)
            q_lo = byte & 15
            q_hi = byte >> 4
        if TYPE == 4:      # Q5_K: bit (block of 32 in the super-block) of byte l
            hb = tl.load(h_ptr + rows * (k // 8) + (((k0 + e_lo) // 256) * 32 + e_lo % 32)[None, :], mask=ok,
                         other=0).to(tl.int32)
            bit = (((k0 + e_lo) % 256) // 32)[None, :]
            q_lo = q_lo | (((hb >> bit) & 1) << 4)
            q_hi = q_hi | (((hb >> (bit + 1)) & 1) << 4)
        if TYPE == 5:      # Q6_K: 2 high bits, byte (value in the half) % 32, pair by quarter
            hb = tl.load(h_ptr + rows * (k // 4) + (k0 // 4 + (u // 4) * 32 + 16 * (u % 2) + i % 16)[None, :],
                         mask=ok, other=0).to(tl.int32)
            shift = (2 * ((u % 4) // 2))[None, :]
            q_lo = (q_lo | (((hb >> shift) & 3) << 4)) - 32
            q_hi = (q_hi | (((hb >> (shift + 4)) & 3) << 4)) - 32
        if TYPE == 0:
            q_lo -= 8
            q_hi -= 8
        blk = j // R       # the column's block
        per = 16 if TYPE == 5 else 32
        cmask = col_ok[:, None] & ((k0 + per * blk) < k)[None, :]
        at = k0 // per + blk[None, :]
        if TYPE <= 2:
            sc = tl.load(s_ptr + rows * (k // 32) + at, mask=cmask, other=0.0).to(tl.float32)
            mn = sc * 0.0
            if TYPE == 1:
                mn = tl.load(m_ptr + rows * (k // 32) + at, mask=cmask, other=0.0).to(tl.float32)
        else:
            sb = (k0 + per * blk[None, :]) // 256
            d = tl.load(d_ptr + rows * (k // 256) + sb, mask=cmask, other=0.0).to(tl.float32)
            if TYPE == 5:
                sc = d * tl.load(s_ptr + rows * (k // 16) + at, mask=cmask, other=0).to(tl.float32)
                mn = sc * 0.0
            else:
                sc = d * tl.load(s_ptr + rows * (k // 32) + at, mask=cmask, other=0).to(tl.float32)
                dm = tl.load(dm_ptr + rows * (k // 256) + sb, mask=cmask, other=0.0).to(tl.float32)
                mn = -dm * tl.load(m_ptr + rows * (k // 32) + at, mask=cmask, other=0).to(tl.float32)
        return q_lo, q_hi, e_lo, e_hi, c_lo, c_hi, sc, mn

    @triton.jit
    def gemv_cols_kernel(x_ptr, q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, out_ptr, rows, n, k, stride_x,
                         stride_o, TYPE: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                         HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        """The GEMV with the scale blocks on the product's columns: a step's 16 blocks and R activation
        rows make the 16 R columns of one tensor-core product whose activation tile is block-diagonal
        (column j holds row j % R's inputs of block j // R, zeros elsewhere), so each column's sum is
        one block's q . x; scales and mins then apply to the [BLOCK_N, 16 R] result, once per step."""
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        j = tl.arange(0, 16 * R)
        r = j % R
        step = 256 if TYPE == 5 else 512
        acc = tl.zeros([BLOCK_N, 16 * R], tl.float32)
        for k0 in range(0, k, step):
            q_lo, q_hi, e_lo, e_hi, c_lo, c_hi, sc, mn = _block_cols(q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr,
                                                                     cols, col_ok, k0, k, j, R, TYPE)
            x_ok = (r < rows)[None, :] & ((k0 + e_lo) < k)[:, None]
            x_lo = tl.load(x_ptr + r[None, :] * stride_x + (k0 + e_lo)[:, None],
                           mask=x_ok & (c_lo[:, None] == j[None, :] // R), other=0.0)
            x_hi = tl.load(x_ptr + r[None, :] * stride_x + (k0 + e_hi)[:, None],
                           mask=x_ok & (c_hi[:, None] == j[None, :] // R), other=0.0)
            if IEEE:
                p = tl.dot(q_lo.to(tl.float32), x_lo, input_precision="ieee")
                p = tl.dot(q_hi.to(tl.float32), x_hi, p, input_precision="ieee")
            else:
                p = tl.dot(q_lo.to(x_lo.dtype), x_lo)
                p = tl.dot(q_hi.to(x_hi.dtype), x_hi, p)
            acc += sc * p
            if TYPE == 1 or TYPE == 3 or TYPE == 4:   # the mins times each block's sum of x
                acc += mn * (tl.sum(x_lo.to(tl.float32), axis=0) + tl.sum(x_hi.to(tl.float32), axis=0))[None, :]
        pdl.release(PDL)
        out = tl.sum(tl.reshape(acc, [BLOCK_N, 16, R]), axis=1)
        rr = tl.arange(0, R)
        bcols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            out += tl.load(b_ptr + bcols, mask=bcols < n, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rr[None, :] * stride_o + bcols[:, None], out.to(out_ptr.dtype.element_ty),
                 mask=(bcols < n)[:, None] & (rr < rows)[None, :])

    @triton.jit
    def dequantize_kernel(q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, out_ptr, n, k, stride_o, TYPE: tl.constexpr,
                          NU: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        k0 = tl.program_id(1) * NU * (64 if TYPE == 3 or TYPE == 4 else 32)
        q_lo, q_hi, s_lo, s_hi, m_lo, m_hi, v_lo, v_hi, u_ok = _units(q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr,
                                                                      cols, col_ok, k0, 0, k, TYPE, NU)
        at = out_ptr + cols.to(tl.int64)[None, :, None] * stride_o
        mask = u_ok[:, None, None] & col_ok[None, :, None] & (v_lo[:, None, :] >= 0)
        dt = out_ptr.dtype.element_ty
        tl.store(at + v_lo[:, None, :], (s_lo * q_lo.to(tl.float32) + m_lo).to(dt), mask=mask)
        tl.store(at + v_hi[:, None, :], (s_hi * q_hi.to(tl.float32) + m_hi).to(dt), mask=mask)


def _planes(w: GgufPlanes) -> list[torch.Tensor]:
    """The six plane arguments in kernel order (an absent plane: the quants, never read)."""
    p = w.planes
    return [p.get(name, p["q"]) for name in ("q", "h", "s", "m", "d", "dm")]


def _units_per_step(w: GgufPlanes, values: int) -> int:
    return max(1, values // VALUES_PER_UNIT[w.type_name])


def _tiles(w: GgufPlanes, rows: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, warps, inputs per step, stages, loop): the best of small sweeps on an H100 over the
    8B shapes (benchmarks/gguf_gpu.py). One row of a type without mins: the block-columns loop
    (qkv: 0.57-0.85x the next best's time); else the batched products on strips of 16 rows, except
    on the widest weights (gate_up), where one product per unit on strips of 64 won."""
    if rows == 1 and w.type_name in ("Q4_0", "Q4_1", "Q8_0", "Q6_K"):
        return (16, 4, 512, 3, 2) if w.type_name == "Q6_K" else (64, 4, 512, 3, 2)
    return (64, 4, 256, 3, 1) if w.n >= 16384 else (16, 4, 512, 4, 0)


def gemv(x: torch.Tensor, w: GgufPlanes, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [rows <= GEMV_ROWS, K] @ W^T (+ bias) -> [rows, n] (into `out`, which may be a column
    slice of a wider output: a fused layer's part). tiles: `_tiles`' settings, for sweeps."""
    rows = x.shape[0]
    block_n, warps, step_values, stages, loop = tiles or _tiles(w, rows)
    if loop == 2 and rows > COLS_ROWS:   # 16 blocks x 16 rows of columns: past shared memory
        block_n, warps, step_values, stages, loop = 16, 4, 512, 4, 0
    out = torch.empty(rows, w.n, dtype=x.dtype, device=x.device) if out is None else out
    if loop == 2:
        gemv_cols_kernel[(cdiv(w.n, block_n),)](
            x, *_planes(w), bias if bias is not None else x, out, rows, w.n, w.k, x.stride(0), out.stride(0),
            TYPE=TYPE_IDS[w.type_name], R=1 if rows == 1 else COLS_ROWS, BLOCK_N=block_n,
            IEEE=x.dtype == torch.float32, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages,
            **pdl.launch_args(x, late=True))
        return out
    gemv_kernel[(cdiv(w.n, block_n),)](
        x, *_planes(w), bias if bias is not None else x, out, rows, w.n, w.k, x.stride(0), out.stride(0),
        TYPE=TYPE_IDS[w.type_name], NU=_units_per_step(w, step_values), BLOCK_N=block_n, BLOCK_M=16, LOOP=loop,
        IEEE=x.dtype == torch.float32, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages,
        **pdl.launch_args(x, late=True))
    return out


def dequantize(w: GgufPlanes, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as [n, K] of `dtype` (into `out`, which may be a row slice of a fused weight)."""
    out = torch.empty(w.n, w.k, dtype=dtype, device=w.planes["q"].device) if out is None else out
    block_n, units = 16, _units_per_step(w, STEP_VALUES)
    dequantize_kernel[(cdiv(w.n, block_n), cdiv(w.k, units * VALUES_PER_UNIT[w.type_name]))](
        *_planes(w), out, w.n, w.k, out.stride(0), TYPE=TYPE_IDS[w.type_name], NU=units, BLOCK_N=block_n,
        num_warps=4, **pdl.launch_args(out))
    return out
