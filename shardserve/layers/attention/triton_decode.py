"""Paged decode attention in Triton: one new token per request, K/V read in place through the
block tables (no gather), GQA-aware (one program per (request, KV head) serves all query heads of
its group), online softmax in fp32. Shapes are static given the batch, so it runs inside CUDA graphs.

KV layout (TorchAttentionBackend's): K and V each [num_kv_heads, num_blocks, block_size, head_dim].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
                         stride_qt, stride_qh, stride_kh, stride_kb, stride_tb, stride_ot, stride_oh,
                         scale, window,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         HEAD_DIM: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    heads = hk * GROUP + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < GROUP, other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    first = 0
    if window > 0:
        first = tl.maximum(seq_len - window, 0)
    for blk in range(first // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        block_id = tl.load(tables_ptr + b * stride_tb + blk).to(tl.int64)
        base = hk * stride_kh + block_id * stride_kb + s[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + base)
        v = tl.load(v_ptr + base)
        if IEEE:   # fp32 caches: no TF32 shortcut, the result must match the torch reference
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale    # [GROUP_PAD, BLOCK_SIZE]
        pos = blk * BLOCK_SIZE + s
        valid = (pos < seq_len) & (pos >= first)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
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
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), scale, window or 0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, HEAD_DIM=dim,
        IEEE=k_cache.dtype == torch.float32)


def supported(head_dim: int, block_size: int) -> bool:
    """tl.dot needs power-of-two tiles of at least 16."""
    def pow2(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0
    return pow2(head_dim) and pow2(block_size)
