"""Paged prefill attention in Triton: every prefill chunk of a step in one launch, any cached prefix
read in place from the pool through the block tables, causal (and sliding-window) masks, online
softmax in fp32 (flash-attention's forward pass over pages).

The new tokens' K/V are written to the pool before this runs, so a chunk's keys are all in the
pool: positions 0 .. context + its own. The work is cut into tiles of BLOCK_M queries of one
request; the host lists the tiles once per step (`prefill_tiles.py`), and the grid is (tile, query
head). KV layout (TorchAttentionBackend's): K and V each [num_kv_heads, num_blocks, block_size, head_dim],
of the activations' dtype, fp32, or fp8 E4M3 with the layer's k_scale / v_scale (triton_paged.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.attention.prefill_tiles import BLOCK_M, PrefillTiles
from shardserve.kernels.attention.triton_paged import load_pages, online_softmax_step

KEYS_PER_ITER = 64


# Integer arguments that change from step to step are not specialised on (Triton would compile a
# new variant for each value of 1 or multiple of 16, a stall of a second in the middle of serving).
# The block tables of a mixed step's prefills are rows of the step's table after its decodes, so
# their address is 16-byte aligned or not by the step: not specialised on, or one step in a few would
# compile a second variant mid-run.
@triton.jit(do_not_specialize=["num_tiles", "num_reqs", "stride_tb", "window", "max_pages"],
            do_not_specialize_on_alignment=["tables_ptr"])
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, tiles_ptr, num_tiles, num_reqs,
                          stride_qt, stride_qh, stride_kh, stride_kb, stride_tb, stride_ot, stride_oh,
                          scale, window, max_pages, k_scale, v_scale,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr,
                          HEAD_DIM: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    # tiles_ptr: [tile request (num_tiles), tile first query (num_tiles), then per request: first
    # flat token, query length, context length (num_reqs each)]
    r = tl.load(tiles_ptr + tile)
    m0 = tl.load(tiles_ptr + num_tiles + tile)
    q_start = tl.load(tiles_ptr + 2 * num_tiles + r)
    q_len = tl.load(tiles_ptr + 2 * num_tiles + num_reqs + r)
    ctx = tl.load(tiles_ptr + 2 * num_tiles + 2 * num_reqs + r)
    hk = h // GROUP
    m = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, PAGES * BLOCK_SIZE)
    rows = m < q_len
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=rows[:, None], other=0.0)
    q_pos = ctx + m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = ctx + tl.minimum(m0 + BLOCK_M, q_len)   # keys up to the tile's last query
    first_page = 0
    if window > 0:
        first_page = tl.maximum(ctx + m0 - window + 1, 0) // BLOCK_SIZE
    for page0 in range(first_page, tl.cdiv(end, BLOCK_SIZE), PAGES):
        k, v = load_pages(k_ptr, v_ptr, tables_ptr + r * stride_tb, page0, max_pages, hk * stride_kh, stride_kb,
                          BLOCK_SIZE=BLOCK_SIZE, PAGES=PAGES, HEAD_DIM=HEAD_DIM)
        k_pos = page0 * BLOCK_SIZE + j
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window > 0:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = online_softmax_step(q, k, v, allowed, m_i, l_i, acc, scale * k_scale, IEEE=IEEE)
    out = acc / l_i[:, None]
    if k_ptr.dtype.element_ty == tl.float8e4nv:
        out = out * v_scale
    tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rows[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: PrefillTiles,
                            out: torch.Tensor, scale: float, window: int | None, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> None:
    """q, out: [T, Hq, D] (the whole step's tokens; tiles index into them); caches
    [Hk, blocks, block_size, D] contiguous (fp8: read times k_scale, v_scale)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    _, hq, dim = q.shape
    hk, _, block_size, _ = k_cache.shape
    tables = tiles.block_tables
    ieee = q.dtype == torch.float32
    keys = KEYS_PER_ITER // 2 if ieee else KEYS_PER_ITER   # fp32 tiles take twice the shared memory
    _paged_prefill_kernel[(tiles.num_tiles, hq)](
        q, k_cache, v_cache, out, tables, tiles.data, tiles.num_tiles, tiles.num_reqs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0),
        out.stride(0), out.stride(1), scale, window or 0, tables.shape[1],
        float(k_scale) if fp8 else 1.0, float(v_scale) if fp8 else 1.0,
        GROUP=hq // hk, BLOCK_M=BLOCK_M, BLOCK_SIZE=block_size, PAGES=max(1, keys // block_size),
        HEAD_DIM=dim, IEEE=ieee, num_stages=2 if ieee else 3)
