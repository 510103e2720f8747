"""GGUF-quantized matmuls in Triton for CUDA: the weight stays in its blocks (regrouped into planes
by kernels/quant/gguf_layout.py) and is dequantized in registers inside the matmul.

Every type pairs two values per quant byte (the low and the high nibble; Q8_0 two bytes): value j and
value j + 16 of a block of 32 (Q4_0, Q4_1, Q8_0), j and j + 32 of 64 (Q4_K, Q5_K), j and j + 64 of
128 (Q6_K). So one load of a strip of quant bytes [BLOCK_N, HALF] gives two weight tiles, and each
is multiplied with the activations gathered at the inputs it holds (`_dequant` returns the tiles
with those input indices): no reordering of the file's quants is needed. Scales and mins are
gathered per value from their planes (each one serves 16-32 values: L1 hits). The weight is
computed in fp32 as the format defines it, d * q (+ m) or (d * sc) * q - dmin * mn.

- `gemv` (1-4 rows, decode): each program owns a strip of output rows and streams their blocks once,
  fp32 FMAs on the CUDA cores.
- `matmul_dot` (5-16 rows): the weight tiles rounded to the activations' dtype, then the tensor cores.
- `dequantize`: the whole weight in bf16/fp16, for cuBLAS on more rows (prefill).
Each kernel begins with `pdl.start(PDL)` (kernels/pdl.py); `gemv` lets the next kernel launch after
its main loop. Under TRITON_INTERPRET=1 they run on CPU tensors (the CPU tests do that).
"""
from __future__ import annotations

import torch

from shardserve.kernels import pdl
from shardserve.kernels.quant.gguf_layout import GgufPlanes
from shardserve.utils import cdiv

GEMV_ROWS = 4    # rows up to this: the FMA kernel
DOT_ROWS = 16    # up to this: the tensor-core kernel; more: dequantize, then cuBLAS
TYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}
# Values one loop step covers: a multiple of the type's pairing unit (32, 64 or 128 values).
CHUNK = {"Q4_0": 128, "Q4_1": 128, "Q8_0": 64, "Q4_K": 128, "Q5_K": 128, "Q6_K": 128}

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    @triton.jit
    def _dequant(q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, cols, col_ok, k0, k, TYPE: tl.constexpr,
                 HALF: tl.constexpr):
        """The weight of rows `cols` at inputs k0 .. k0 + 2 HALF as two fp32 tiles [BLOCK_N, HALF]
        (the low and high values of each quant byte), their input indices [HALF] and which of
        those lie inside K (the module docstring)."""
        i = tl.arange(0, HALF)
        if TYPE <= 2:      # Q4_0, Q4_1, Q8_0: value j and j + 16 of each block of 32
            e_lo = k0 + (i // 16) * 32 + i % 16
            e_hi = e_lo + 16
        elif TYPE <= 4:    # Q4_K, Q5_K: value j and j + 32 of each 64
            e_lo = k0 + (i // 32) * 64 + i % 32
            e_hi = e_lo + 32
        else:              # Q6_K: value j and j + 64 of each 128
            e_lo = k0 + (i // 64) * 128 + i % 64
            e_hi = e_lo + 64
        ok = e_lo < k
        rows = cols[:, None].to(tl.int64)
        mask = col_ok[:, None] & ok[None, :]
        if TYPE == 2:      # Q8_0: int8 quants, one fp16 scale per 32
            s = tl.load(s_ptr + rows * (k // 32) + (e_lo // 32)[None, :], mask=mask, other=0.0).to(tl.float32)
            a = tl.load(q_ptr + rows * k + e_lo[None, :], mask=mask, other=0).to(tl.float32)
            b = tl.load(q_ptr + rows * k + e_hi[None, :], mask=mask, other=0).to(tl.float32)
            return s * a, s * b, e_lo, e_hi, ok
        byte = tl.load(q_ptr + rows * (k // 2) + (k0 // 2 + i)[None, :], mask=mask, other=0).to(tl.int32)
        lo = byte & 15
        hi = byte >> 4
        if TYPE <= 1:      # Q4_0: d (q - 8); Q4_1: d q + m
            s = tl.load(s_ptr + rows * (k // 32) + (e_lo // 32)[None, :], mask=mask, other=0.0).to(tl.float32)
            if TYPE == 0:
                return s * (lo - 8).to(tl.float32), s * (hi - 8).to(tl.float32), e_lo, e_hi, ok
            m = tl.load(m_ptr + rows * (k // 32) + (e_lo // 32)[None, :], mask=mask, other=0.0).to(tl.float32)
            return s * lo.to(tl.float32) + m, s * hi.to(tl.float32) + m, e_lo, e_hi, ok
        sb = (e_lo // 256)[None, :]
        d = tl.load(d_ptr + rows * (k // 256) + sb, mask=mask, other=0.0).to(tl.float32)
        if TYPE == 5:      # Q6_K: 2 high bits per value, an int8 scale per 16: (d sc) (q - 32)
            t = e_lo % 128   # < 64: the high value is t + 64
            hb = tl.load(h_ptr + rows * (k // 4) + ((e_lo // 128) * 32 + t % 32)[None, :], mask=mask,
                         other=0).to(tl.int32)
            shift = (2 * (t // 32))[None, :]
            lo = (lo | (((hb >> shift) & 3) << 4)) - 32
            hi = (hi | (((hb >> (shift + 4)) & 3) << 4)) - 32
            sc_lo = tl.load(s_ptr + rows * (k // 16) + (e_lo // 16)[None, :], mask=mask, other=0).to(tl.float32)
            sc_hi = tl.load(s_ptr + rows * (k // 16) + (e_hi // 16)[None, :], mask=mask, other=0).to(tl.float32)
            return (d * sc_lo) * lo.to(tl.float32), (d * sc_hi) * hi.to(tl.float32), e_lo, e_hi, ok
        # Q4_K, Q5_K: per block of 32 a 6-bit scale and min (bytes here): (d sc) q - dmin mn
        if TYPE == 4:      # Q5_K: 1 high bit per value, bit (block of 32 in the super-block) of byte j
            hb = tl.load(h_ptr + rows * (k // 8) + ((e_lo // 256) * 32 + e_lo % 32)[None, :], mask=mask,
                         other=0).to(tl.int32)
            bit = ((e_lo % 256) // 32)[None, :]
            lo = lo | (((hb >> bit) & 1) << 4)
            hi = hi | (((hb >> (bit + 1)) & 1) << 4)
        dm = tl.load(dm_ptr + rows * (k // 256) + sb, mask=mask, other=0.0).to(tl.float32)
        blk = (e_lo // 32)[None, :]
        sc_lo = tl.load(s_ptr + rows * (k // 32) + blk, mask=mask, other=0).to(tl.float32)
        sc_hi = tl.load(s_ptr + rows * (k // 32) + blk + 1, mask=mask, other=0).to(tl.float32)
        mn_lo = tl.load(m_ptr + rows * (k // 32) + blk, mask=mask, other=0).to(tl.float32)
        mn_hi = tl.load(m_ptr + rows * (k // 32) + blk + 1, mask=mask, other=0).to(tl.float32)
        return ((d * sc_lo) * lo.to(tl.float32) - dm * mn_lo, (d * sc_hi) * hi.to(tl.float32) - dm * mn_hi,
                e_lo, e_hi, ok)

    @triton.jit
    def gemv_kernel(x_ptr, q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, out_ptr, rows, n, k, stride_x,
                    stride_o, TYPE: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        r = tl.arange(0, ROWS)
        r_ok = r < rows
        acc = tl.zeros([ROWS, BLOCK_N, HALF], tl.float32)
        for k0 in range(0, k, 2 * HALF):
            w_lo, w_hi, e_lo, e_hi, ok = _dequant(q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, cols, col_ok, k0, k,
                                                  TYPE, HALF)
            x_mask = r_ok[:, None] & ok[None, :]
            x_lo = tl.load(x_ptr + r[:, None] * stride_x + e_lo[None, :], mask=x_mask, other=0.0).to(tl.float32)
            x_hi = tl.load(x_ptr + r[:, None] * stride_x + e_hi[None, :], mask=x_mask, other=0.0).to(tl.float32)
            acc += w_lo[None, :, :] * x_lo[:, None, :] + w_hi[None, :, :] * x_hi[:, None, :]
        pdl.release(PDL)
        out = tl.sum(acc, axis=2)
        if HAS_BIAS:
            out += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + r[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & col_ok[None, :])

    @triton.jit
    def matmul_dot_kernel(x_ptr, q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, out_ptr, rows, n, k, stride_x,
                          stride_o, TYPE: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        r_ok = r < rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k, 2 * HALF):
            w_lo, w_hi, e_lo, e_hi, ok = _dequant(q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, cols, col_ok, k0, k,
                                                  TYPE, HALF)
            x_mask = r_ok[:, None] & ok[None, :]
            x_lo = tl.load(x_ptr + r[:, None].to(tl.int64) * stride_x + e_lo[None, :], mask=x_mask, other=0.0)
            x_hi = tl.load(x_ptr + r[:, None].to(tl.int64) * stride_x + e_hi[None, :], mask=x_mask, other=0.0)
            acc = tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), acc)
            acc = tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + r[:, None].to(tl.int64) * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & col_ok[None, :])

    @triton.jit
    def dequantize_kernel(q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, out_ptr, n, k, stride_o, TYPE: tl.constexpr,
                          HALF: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        w_lo, w_hi, e_lo, e_hi, ok = _dequant(q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, cols, col_ok,
                                              tl.program_id(1) * 2 * HALF, k, TYPE, HALF)
        at = out_ptr + cols[:, None].to(tl.int64) * stride_o
        mask = col_ok[:, None] & ok[None, :]
        tl.store(at + e_lo[None, :], w_lo.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(at + e_hi[None, :], w_hi.to(out_ptr.dtype.element_ty), mask=mask)


def _planes(w: GgufPlanes) -> list[torch.Tensor]:
    """The six plane arguments in kernel order (an absent plane: the quants, never read)."""
    p = w.planes
    return [p.get(name, p["q"]) for name in ("q", "h", "s", "m", "d", "dm")]


def _common(w: GgufPlanes) -> dict:
    return {"TYPE": TYPE_IDS[w.type_name], "HALF": CHUNK[w.type_name] // 2}


def gemv(x: torch.Tensor, w: GgufPlanes, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         block_n: int = 16, warps: int = 4) -> torch.Tensor:
    """x [rows <= GEMV_ROWS, K] @ W^T (+ bias) -> [rows, n] (into `out`, which may be a column
    slice of a wider output: a fused layer's part)."""
    rows = x.shape[0]
    out = torch.empty(rows, w.n, dtype=x.dtype, device=x.device) if out is None else out
    gemv_kernel[(cdiv(w.n, block_n),)](
        x, *_planes(w), bias if bias is not None else x, out, rows, w.n, w.k, x.stride(0), out.stride(0),
        ROWS=max(1, 1 << (rows - 1).bit_length()), BLOCK_N=block_n, HAS_BIAS=bias is not None, num_warps=warps,
        **_common(w), **pdl.launch_args(x, late=True))
    return out


def matmul_dot(x: torch.Tensor, w: GgufPlanes, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
               block_m: int = 16, block_n: int = 64, warps: int = 4) -> torch.Tensor:
    """x [rows, K] @ W^T (+ bias) on the tensor cores (into `out` as `gemv`)."""
    rows = x.shape[0]
    out = torch.empty(rows, w.n, dtype=x.dtype, device=x.device) if out is None else out
    matmul_dot_kernel[(cdiv(w.n, block_n), cdiv(rows, block_m))](
        x, *_planes(w), bias if bias is not None else x, out, rows, w.n, w.k, x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=bias is not None, num_warps=warps, **_common(w),
        **pdl.launch_args(x))
    return out


def dequantize(w: GgufPlanes, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as [n, K] of `dtype` (into `out`, which may be a row slice of a fused weight)."""
    out = torch.empty(w.n, w.k, dtype=dtype, device=w.planes["q"].device) if out is None else out
    block_n = 16
    common = _common(w)
    dequantize_kernel[(cdiv(w.n, block_n), cdiv(w.k, 2 * common["HALF"]))](
        *_planes(w), out, w.n, w.k, out.stride(0), BLOCK_N=block_n, num_warps=4, **common,
        **pdl.launch_args(out))
    return out


def matmul(x: torch.Tensor, parts: list[tuple[slice, GgufPlanes]], n: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] @ W^T (+ bias) for a weight [n, K] held as runs of output rows, each of one GGUF
    type (a fused q/k/v or gate/up whose parts differ in type has several): by rows, the FMA
    kernel, the tensor-core kernel, or the weight dequantized for cuBLAS (also fp32 activations
    past the FMA kernel: the tensor cores would round them to tf32)."""
    rows, k = x.shape[0], parts[0][1].k
    if rows > DOT_ROWS or (rows > GEMV_ROWS and x.dtype == torch.float32):
        w = torch.empty(n, k, dtype=x.dtype, device=x.device)
        for at, part in parts:
            dequantize(part, x.dtype, out=w[at])
        return torch.nn.functional.linear(x, w, bias)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        kernel = gemv if rows <= GEMV_ROWS else matmul_dot
        for at, part in parts:
            kernel(x, part, None if bias is None else bias[at], out=out[:, at])
    return out
