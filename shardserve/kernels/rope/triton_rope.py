"""Rotary embedding (NeoX / rotate-half layout) in Triton, for CUDA: on its own, rotating q and k in
place, or fused with the attention's K/V write, where one launch rotates q, rotates k and stores it
with v into the paged pool (a decode layer would otherwise spend two launches on them). Both round
where the torch code rounds (cos/sin cast to the activations' dtype, each product rounded), so the
paths agree bit for bit. Imported only where Triton runs (kernels/triton_ops.rotary_neox_, the CUDA attention backend).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels import pdl
from shardserve.kernels.attention.triton_paged import to_pool
from shardserve.kernels.rope.layout import heads_packed, triton_tileable


@triton.jit
def _product(x, c):
    """x * c rounded to x's dtype, as torch rounds each product. The multiply is mul.rn: a plain one
    may be contracted with the subtraction after it into one fma (in bf16 or fp32), which skips this
    rounding, and whether it is depends on the kernel around it; one with a rounding mode never is."""
    xc = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x.to(tl.float32), c], dtype=tl.float32,
                                   is_pure=True, pack=1)
    return xc.to(x.dtype).to(tl.float32)


@triton.jit
def _rotate(x1, x2, c, s):
    """(x1 * c - x2 * s, x2 * c + x1 * s) with cos/sin cast to x's dtype and each product rounded to
    it, as torch computes it."""
    dt = x1.dtype
    c = c.to(dt).to(tl.float32)
    s = s.to(dt).to(tl.float32)
    return (_product(x1, c) - _product(x2, s)).to(dt), (_product(x2, c) + _product(x1, s)).to(dt)


@triton.jit
def rotate_whole(x, partner, c, s, first_half):
    """_rotate on whole rows: x * c - partner * s where first_half, x * c + partner * s elsewhere,
    partner being the other half's element (x[(d + D/2) % D]) and c, s the row's cos/sin for d % (D/2).
    The same roundings as _rotate, so the same bits."""
    dt = x.dtype
    c = c.to(dt).to(tl.float32)
    s = s.to(dt).to(tl.float32)
    a = _product(x, c)
    b = _product(partner, s)
    return tl.where(first_half, a - b, a + b).to(dt)


@triton.jit
def _rotate_in_place(base, cos_row, sin_row, HALF: tl.constexpr):
    i = tl.arange(0, HALF)
    y1, y2 = _rotate(tl.load(base + i), tl.load(base + HALF + i), tl.load(cos_row + i), tl.load(sin_row + i))
    tl.store(base + i, y1)
    tl.store(base + HALF + i, y2)
    return y1, y2


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_stride, k_stride, n_q, HALF: tl.constexpr,
                   PDL: tl.constexpr):
    pdl.start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    if h < n_q:
        base = q_ptr + t * q_stride + h * 2 * HALF
    else:
        base = k_ptr + t * k_stride + (h - n_q) * 2 * HALF
    _rotate_in_place(base, cos_ptr + pos * HALF, sin_ptr + pos * HALF, HALF)


@triton.jit(do_not_specialize=["pool_slots"])
def _rotary_write_kv_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                            stride_qt, stride_kt, stride_vt, n_kv, pool_slots, k_scale, v_scale,
                            HALF: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)   # KV heads first, then query heads
    pos = tl.load(pos_ptr + t)
    cos_row, sin_row = cos_ptr + pos * HALF, sin_ptr + pos * HALF
    if h < n_kv:
        i = tl.arange(0, HALF)
        k1, k2 = _rotate_in_place(k_ptr + t * stride_kt + h * 2 * HALF, cos_row, sin_row, HALF)
        dst = (h * pool_slots + tl.load(slots_ptr + t)) * 2 * HALF
        dt = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst + i, to_pool(k1, k_scale, dt))
        tl.store(k_cache_ptr + dst + HALF + i, to_pool(k2, k_scale, dt))
        d = tl.arange(0, 2 * HALF)
        tl.store(v_cache_ptr + dst + d, to_pool(tl.load(v_ptr + t * stride_vt + h * 2 * HALF + d), v_scale, dt))
    else:
        _rotate_in_place(q_ptr + t * stride_qt + (h - n_kv) * 2 * HALF, cos_row, sin_row, HALF)


def fusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Head rows packed and a power-of-two half (a Triton tile), on CUDA."""
    return q.is_cuda and heads_packed(q, k, v) and triton_tileable(q.shape[-1])


def rotary_neox_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (head rows packed)."""
    t, hq, dim = q.shape
    _rotary_kernel[(t, hq + k.shape[1])](positions, q, k, cos, sin, q.stride(0), k.stride(0), hq, HALF=dim // 2,
                                         **pdl.launch_args(q))


def rotary_and_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Rotate q and k in place and store the rotated k and v ([T, Hk, D], head rows packed) at
    `slots` of the pool (each cache [Hk, blocks, block_size, D]; an fp8 one takes k / k_scale and
    v / v_scale)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    t, hq, dim = q.shape
    hk, blocks, block_size, _ = k_cache.shape
    _rotary_write_kv_kernel[(t, hk + hq)](positions, q, k, v, cos, sin, k_cache, v_cache, slots,
                                         q.stride(0), k.stride(0), v.stride(0), hk, blocks * block_size,
                                         float(k_scale) if fp8 else 1.0, float(v_scale) if fp8 else 1.0,
                                         HALF=dim // 2, **pdl.launch_args(q))
