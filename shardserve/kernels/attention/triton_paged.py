"""Triton pieces shared by the paged attention kernels (decode and prefill): a tile of keys and
values gathered through a request's block table, one online-softmax step over it, and a value as
the pool stores it.

An fp8 pool (`--kv-cache-dtype fp8`, E4M3) holds x / scale, rounded to nearest even and saturated
at +-448 (kernels/attention/kv_fp8.py is the reference): `to_pool` stores so, with IEEE division
(Triton's `/` is approximate), and the kernels widen what they load to the activations' dtype
(exact) and fold the layer's scales into the softmax scale (k_scale) and the output (v_scale)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_pages(k_ptr, v_ptr, table_ptr, page0, max_pages, head_base, stride_kb,
               BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K and V ([PAGES * BLOCK_SIZE, HEAD_DIM]) of the positions from page `page0` on, through one
    request's block-table row (`table_ptr`); pages past the row's width read block 0, the null block."""
    j = tl.arange(0, PAGES * BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    page = page0 + j // BLOCK_SIZE
    block_id = tl.load(table_ptr + page, mask=page < max_pages, other=0).to(tl.int64)
    base = head_base + block_id[:, None] * stride_kb + (j % BLOCK_SIZE)[:, None] * HEAD_DIM + d[None, :]
    return tl.load(k_ptr + base), tl.load(v_ptr + base)


@triton.jit
def to_pool(x, scale, dt: tl.constexpr):
    """x as a pool of element type `dt` stores it: cast, or for E4M3 x / scale saturated and rounded."""
    if dt == tl.float8e4nv:
        y = tl.math.div_rn(x.to(tl.float32), scale)
        return tl.minimum(tl.maximum(y, -448.0), 448.0).to(dt)
    return x.to(dt)


@triton.jit
def online_softmax_step(q, k, v, allowed, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """Fold one tile of keys into the running max, sum and output of flash attention. `allowed`
    masks [query rows, keys]; a row with no allowed key yet keeps zero weight (no NaN). Keys and
    values from an fp8 pool are widened to q's dtype here (the caller applies the scales)."""
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if IEEE:   # fp32 caches: no TF32 shortcut, the result must match the torch reference
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i, acc
