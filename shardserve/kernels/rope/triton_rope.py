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
def _rotate_heads(row, n_heads, c, s, HEADS: tl.constexpr, HALF: tl.constexpr):
    """Rotate in place the first n_heads heads of one token's row of packed heads (a [HEADS, HALF]
    tile of each half); returns the rotated halves and the tile's head mask."""
    h = tl.arange(0, HEADS)[:, None]
    i = tl.arange(0, HALF)[None, :]
    ok = h < n_heads
    first = row + h * 2 * HALF + i
    y1, y2 = _rotate(tl.load(first, mask=ok), tl.load(first + HALF, mask=ok), c, s)
    tl.store(first, y1, mask=ok)
    tl.store(first + HALF, y2, mask=ok)
    return y1, y2, ok


# One program per token, all its heads at once: one per (token, head) moved 256 bytes each and
# ran at a seventh of the copy bandwidth (a 2048-token Llama-3-8B step: 125 us a layer on an H100).
@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_stride, k_stride, n_q, n_kv, HALF: tl.constexpr,
                   Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, HALF)[None, :]
    c, s = tl.load(cos_ptr + pos * HALF + i), tl.load(sin_ptr + pos * HALF + i)
    _rotate_heads(q_ptr + t * q_stride, n_q, c, s, Q_HEADS, HALF)
    _rotate_heads(k_ptr + t * k_stride, n_kv, c, s, KV_HEADS, HALF)


@triton.jit(do_not_specialize=["pool_slots"])
def _rotary_write_kv_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                            stride_qt, stride_kt, stride_vt, n_q, n_kv, pool_slots, k_scale, v_scale,
                            HALF: tl.constexpr, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, HALF)[None, :]
    c, s = tl.load(cos_ptr + pos * HALF + i), tl.load(sin_ptr + pos * HALF + i)
    k1, k2, ok = _rotate_heads(k_ptr + t * stride_kt, n_kv, c, s, KV_HEADS, HALF)
    h = tl.arange(0, KV_HEADS)[:, None]
    dst = (h.to(tl.int64) * pool_slots + tl.load(slots_ptr + t)) * (2 * HALF)
    dt = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst + i, to_pool(k1, k_scale, dt), mask=ok)
    tl.store(k_cache_ptr + dst + HALF + i, to_pool(k2, k_scale, dt), mask=ok)
    d = tl.arange(0, 2 * HALF)[None, :]
    v = tl.load(v_ptr + t * stride_vt + h * 2 * HALF + d, mask=ok)
    tl.store(v_cache_ptr + dst + d, to_pool(v, v_scale, dt), mask=ok)
    _rotate_heads(q_ptr + t * stride_qt, n_q, c, s, Q_HEADS, HALF)


def fusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Head rows packed and a power-of-two half (a Triton tile), on CUDA."""
    return q.is_cuda and heads_packed(q, k, v) and triton_tileable(q.shape[-1])


def rotary_neox_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (head rows packed)."""
    t, hq, dim = q.shape
    hk = k.shape[1]
    _rotary_kernel[(t,)](positions, q, k, cos, sin, q.stride(0), k.stride(0), hq, hk, HALF=dim // 2,
                         Q_HEADS=triton.next_power_of_2(hq), KV_HEADS=triton.next_power_of_2(hk), **pdl.launch_args(q))


def rotary_and_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Rotate q and k in place and store the rotated k and v ([T, Hk, D], head rows packed) at
    `slots` of the pool (each cache [Hk, blocks, block_size, D]; an fp8 one takes k / k_scale and
    v / v_scale)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    t, hq, dim = q.shape
    hk, blocks, block_size, _ = k_cache.shape
    _rotary_write_kv_kernel[(t,)](positions, q, k, v, cos, sin, k_cache, v_cache, slots,
                                  q.stride(0), k.stride(0), v.stride(0), hq, hk, blocks * block_size,
                                  float(k_scale) if fp8 else 1.0, float(v_scale) if fp8 else 1.0,
                                  HALF=dim // 2, Q_HEADS=triton.next_power_of_2(hq),
                                  KV_HEADS=triton.next_power_of_2(hk), **pdl.launch_args(q))
