"""Paged decode attention in Triton: one new token per request, K/V read in place through the
block tables (no gather), GQA-aware (one program per (request, KV head) serves all query heads of
its group), online softmax in fp32. Shapes are static given the batch, so it runs inside CUDA graphs.
Each loop iteration takes several pages (about 64 tokens): with few requests there are only a few
programs, and each iteration's chain of dependent loads is the cost, so fewer, wider ones win.

KV layout (TorchAttentionBackend's): K and V each [num_kv_heads, num_blocks, block_size, head_dim].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.layers.attention.triton_paged import load_pages, online_softmax_step


@triton.jit(do_not_specialize=["stride_tb", "window", "max_pages"])   # they change between eager steps
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
                         stride_qt, stride_qh, stride_kh, stride_kb, stride_tb, stride_ot, stride_oh,
                         scale, window, max_pages,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         PAGES: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, PAGES * BLOCK_SIZE)   # token within the tile
    heads = hk * GROUP + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < GROUP, other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    first = 0
    if window > 0:
        first = tl.maximum(seq_len - window, 0)
    for page0 in range(first // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE), PAGES):
        k, v = load_pages(k_ptr, v_ptr, tables_ptr + b * stride_tb, page0, max_pages, hk * stride_kh, stride_kb,
                          BLOCK_SIZE=BLOCK_SIZE, PAGES=PAGES, HEAD_DIM=HEAD_DIM)
        pos = page0 * BLOCK_SIZE + j
        valid = (pos < seq_len) & (pos >= first)
        m_i, l_i, acc = online_softmax_step(q, k, v, valid[None, :], m_i, l_i, acc, scale, IEEE=IEEE)
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g[:, None] < GROUP)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                           scale: float, window: int | None) -> None:
    """q, out: [B, Hq, D] (head rows packed); caches [Hk, blocks, block_size, D] contiguous;
    block_tables [B, max_blocks] int32; seq_lens [B] int32 (tokens including the new one)."""
    batch, hq, dim = q.shape
    hk, _, block_size, _ = k_cache.shape
    group = hq // hk
    grid = (batch, hk)
    # Pages past a request's length hold masked-out keys: a table entry past the table's width
    # reads block 0 instead, so no index runs off the table.
    pages = max(1, 64 // block_size) if k_cache.dtype != torch.float32 else max(1, 32 // block_size)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), scale, window or 0, block_tables.shape[1],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, PAGES=pages,
        HEAD_DIM=dim, IEEE=k_cache.dtype == torch.float32)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     pool_slots, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    slot = tl.load(slots_ptr + t)
    dst = (h * pool_slots + slot) * HEAD_DIM + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty))
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """New tokens' k, v ([T, Hk, D], head rows packed) into the pool at `slots` (int64): one launch
    for both, where indexed assignment takes one per tensor."""
    tokens, hk, dim = k.shape
    _, blocks, block_size, _ = k_cache.shape
    _write_kv_kernel[(tokens, hk)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                   blocks * block_size, HEAD_DIM=dim)


def supported(head_dim: int, block_size: int) -> bool:
    """tl.dot needs power-of-two tiles of at least 16."""
    def pow2(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0
    return pow2(head_dim) and pow2(block_size)
