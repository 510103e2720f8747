"""Paged decode attention in Triton: one new token per request, K/V read in place through the
block tables (no gather), GQA-aware (one program per (request, KV head) serves all query heads of
its group), online softmax in fp32. Shapes are static given the batch, so it runs inside CUDA graphs.
Each loop iteration takes several pages (about 64 tokens): with few requests there are only a few
programs, and each iteration's chain of dependent loads is the cost, so fewer, wider ones win.
With few requests each request's keys are also split over several programs (flash-decoding), and
a small second kernel merges the splits. In decode-only steps the kernel also rotates q and the new
k (rotary embedding) and stores the new K/V, which the split reading the new token's page does
before it reads it: one launch fewer per layer than the rotary + K/V write kernel first.

KV layout (TorchAttentionBackend's): K and V each [num_kv_heads, num_blocks, block_size, head_dim],
of the activations' dtype, fp32, or fp8 E4M3 with the layer's k_scale / v_scale (triton_paged.py).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from shardserve.kernels import pdl
from shardserve.kernels.attention.triton_paged import load_pages, online_softmax_step, to_pool
from shardserve.kernels.rope.triton_rope import rotate_whole


# The arguments not specialised on change between steps.
@triton.jit(do_not_specialize=["stride_tb", "window", "max_pages", "num_splits", "pool_slots"])
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, stats_ptr,
                         stride_qt, stride_qh, stride_kh, stride_kb, stride_tb, stride_ot, stride_oh,
                         scale, window, max_pages, num_splits,
                         pos_ptr, new_k_ptr, new_v_ptr, cos_ptr, sin_ptr, slots_ptr, stride_nk, stride_nv, pool_slots,
                         k_scale, v_scale, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         PAGES: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr, ROPE: tl.constexpr,
                         F16_KV: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    hk = tl.program_id(0)   # programs start in grid order, a request's KV heads side by side
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, PAGES * BLOCK_SIZE)   # token within the tile
    heads = hk * GROUP + g
    q_rows = q_ptr + b * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=g[:, None] < GROUP, other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    first = 0
    if window > 0:
        first = tl.maximum(seq_len - window, 0)
    # This split's pages: an equal share of the request's, in whole tiles (a split may get none).
    first_page, end_page = first // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)
    share = tl.cdiv(tl.cdiv(end_page - first_page, num_splits), PAGES) * PAGES
    start = first_page + split * share
    stop = tl.minimum(start + share, end_page)
    if ROPE:   # q and the new k arrive unrotated: rotate them here, and store the new K/V first
        half = HEAD_DIM // 2
        other = (d + half) % HEAD_DIM   # each element's partner in the other half
        position = tl.load(pos_ptr + b)
        c = tl.load(cos_ptr + position * half + d % half)
        s = tl.load(sin_ptr + position * half + d % half)
        q = rotate_whole(q, tl.load(q_rows + other[None, :], mask=g[:, None] < GROUP, other=0.0), c[None, :],
                         s[None, :], d[None, :] < half)
        new_page = (seq_len - 1) // BLOCK_SIZE
        if (new_page >= start) & (new_page < stop):   # only the split that reads the new token's page
            k_row = new_k_ptr + b * stride_nk + hk * HEAD_DIM
            new_k = rotate_whole(tl.load(k_row + d), tl.load(k_row + other), c, s, d < half)
            dst = (hk * pool_slots + tl.load(slots_ptr + b)) * HEAD_DIM + d
            dt = k_ptr.dtype.element_ty
            tl.store(k_ptr + dst, to_pool(new_k, k_scale, dt))
            tl.store(v_ptr + dst, to_pool(tl.load(new_v_ptr + b * stride_nv + hk * HEAD_DIM + d), v_scale, dt))
            tl.debug_barrier()   # every thread's stores land before any thread loads that page
    if F16_KV:   # an fp8 pool widened to fp16, one conversion per two values (bf16 takes three): q too
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    for page0 in range(start, stop, PAGES):
        k, v = load_pages(k_ptr, v_ptr, tables_ptr + b * stride_tb, page0, max_pages, hk * stride_kh, stride_kb,
                          BLOCK_SIZE=BLOCK_SIZE, PAGES=PAGES, HEAD_DIM=HEAD_DIM)
        pos = page0 * BLOCK_SIZE + j
        valid = (pos < seq_len) & (pos >= first)
        m_i, l_i, acc = online_softmax_step(q, k, v, valid[None, :], m_i, l_i, acc, scale * k_scale, IEEE=IEEE)
    if k_ptr.dtype.element_ty == tl.float8e4nv:   # the values' scale, once on the (partial) output
        acc = acc * v_scale
    if num_splits == 1:
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g[:, None] < GROUP)
    else:   # unnormalised partial output and its (max, sum) per head, for _merge_splits_kernel
        row = (b * (tl.num_programs(0) * GROUP) + heads) * num_splits + split   # [batch, heads, splits]
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g[:, None] < GROUP)
        tl.store(stats_ptr + row * 2, m_i, mask=g < GROUP)
        tl.store(stats_ptr + row * 2 + 1, l_i, mask=g < GROUP)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(part_ptr, stats_ptr, out_ptr, stride_ot, stride_oh, num_splits,
                         MAX_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    """One (request, query head): rescale each split's partial output to the common max and sum."""
    pdl.start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, MAX_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    row = (b * tl.num_programs(1) + h) * num_splits + s
    ok = s < num_splits
    m = tl.load(stats_ptr + row * 2, mask=ok, other=float("-inf"))
    l = tl.load(stats_ptr + row * 2 + 1, mask=ok, other=0.0)
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))   # a split with no keys weighs nothing
    out = tl.sum(part * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


MAX_SPLITS = 16

# What an fp8 pool's keys and values widen to beside bf16 queries: "fp16" (the default: one
# conversion instruction per two values, where bf16 takes three, and q rounded to fp16 too, exact
# in its range) or "bf16" (the activations' dtype). fp16 measured 1.04-1.45x faster alone on an
# H100 (ragged batches of 64-256 requests) and +1-8% on G2 with FP8 weights (BENCHMARKS.md).
FP8_KV_WIDEN = os.environ.get("SHARDSERVE_FP8_KV_WIDEN", "fp16")
if FP8_KV_WIDEN not in ("fp16", "bf16"):
    raise ValueError(f"SHARDSERVE_FP8_KV_WIDEN={FP8_KV_WIDEN!r}: expected fp16 or bf16")


@functools.cache
def _unused_f32(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Splits of each request's keys: enough programs to give every multiprocessor about two,
    whatever the batch (few requests with long contexts would otherwise run on a few SMs, one
    long chain of loads each), and none once the batch alone fills the GPU. Decided from shapes
    only, so a captured graph's split count holds for any lengths."""
    return max(1, min(MAX_SPLITS, 2 * _multiprocessors(device) // (batch * kv_heads)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                           scale: float, window: int | None, splits: int | None = None,
                           rope: tuple | None = None, tune: dict | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """q, out: [B, Hq, D] (head rows packed); caches [Hk, blocks, block_size, D] contiguous;
    block_tables [B, max_blocks] int32; seq_lens [B] int32 (tokens including the new one).
    With several splits (flash-decoding), each split of a request's keys is one program and a
    second kernel merges their partial results. rope: (positions [B], new k, new v [B, Hk, D]
    (head rows packed), cos, sin [max_position, D / 2], slots [B]): q and the new k are not rotated
    yet and the new K/V not stored; the kernel does both (the rotation and the store of
    triton_rope.rotary_and_write_kv, bit for bit), one launch fewer per layer. k_scale, v_scale: an
    fp8 pool's scales (ignored for other pools but by the store of k / v). Programs start in the
    batch's order: a large batch of ragged lengths has about one program per (request, KV head) for
    each slot of the GPU, so the engine puts the longest contexts first (worker/input_batch.py), and
    the short ones fill the tail instead of a long one running alone at the end."""
    batch, hq, dim = q.shape
    hk, _, block_size, _ = k_cache.shape
    group = hq // hk
    splits = splits or num_splits(batch, hk, q.device)
    # Pages past a request's length hold masked-out keys: a table entry past the table's width
    # reads block 0 instead, so no index runs off the table.
    pages = max(1, 64 // block_size) if k_cache.dtype != torch.float32 else max(1, 32 // block_size)
    # The benchmark's sweep: tokens per iteration, num_warps, num_stages, and f16_kv (FP8_KV_WIDEN).
    tune = dict(tune or {})
    pages = max(1, tune.pop("tokens", pages * block_size) // block_size)
    f16_kv = (tune.pop("f16_kv", FP8_KV_WIDEN == "fp16") and k_cache.dtype == torch.float8_e4m3fn
              and q.dtype == torch.bfloat16)
    # Unused with one split, but of the same dtype: a pointer's dtype picks the compiled variant, and
    # a variant first met mid-run stalls that step while Triton compiles it.
    part = stats = _unused_f32(q.device)
    if splits > 1:
        part = torch.empty(batch, hq, splits, dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(batch, hq, splits, 2, dtype=torch.float32, device=q.device)
    positions, new_k, new_v, cos, sin, slots = rope or (seq_lens, q, q, q, q, seq_lens)   # unused without rope
    _paged_decode_kernel[(hk, batch, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part, stats,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), scale, window or 0, block_tables.shape[1], splits,
        positions, new_k, new_v, cos, sin, slots, new_k.stride(0), new_v.stride(0), k_cache.shape[1] * block_size,
        *_scales(k_cache, k_scale, v_scale),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, PAGES=pages,
        HEAD_DIM=dim, IEEE=q.dtype == torch.float32, ROPE=rope is not None, F16_KV=f16_kv, **pdl.launch_args(q),
        **tune)
    if splits > 1:
        _merge_splits_kernel[(batch, hq)](part, stats, out, out.stride(0), out.stride(1), splits,
                                          MAX_SPLITS=MAX_SPLITS, HEAD_DIM=dim, **pdl.launch_args(q))


def _scales(k_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales a kernel gets: an fp8 pool's own, 1.0 for others (fp32 arguments either way, so no
    value of them compiles another variant)."""
    return (float(k_scale), float(v_scale)) if k_cache.dtype == torch.float8_e4m3fn else (1.0, 1.0)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     pool_slots, k_scale, v_scale, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    slot = tl.load(slots_ptr + t)
    dst = (h * pool_slots + slot) * HEAD_DIM + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
    tl.store(k_cache_ptr + dst, to_pool(k, k_scale, k_cache_ptr.dtype.element_ty))
    tl.store(v_cache_ptr + dst, to_pool(v, v_scale, v_cache_ptr.dtype.element_ty))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """New tokens' k, v ([T, Hk, D], head rows packed) into the pool at `slots` (int64): one launch
    for both, where indexed assignment takes one per tensor. An fp8 pool takes k / k_scale, v / v_scale."""
    tokens, hk, dim = k.shape
    _, blocks, block_size, _ = k_cache.shape
    _write_kv_kernel[(tokens, hk)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                   blocks * block_size, *_scales(k_cache, k_scale, v_scale), HEAD_DIM=dim,
                                   **pdl.launch_args(k))


def supported(head_dim: int, block_size: int) -> bool:
    """tl.dot needs power-of-two tiles of at least 16."""
    def pow2(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0
    return pow2(head_dim) and pow2(block_size)
