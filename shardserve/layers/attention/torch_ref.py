"""Paged attention in plain torch: correct on CPU and CUDA, and the oracle for faster kernels.

Decodes are batched: every decode request's blocks are gathered through its block table into one
padded [B, max_blocks] batch (padding points at the zero null block and is masked). Prefill
chunks are handled one request at a time with torch's SDPA, reading any cached prefix from the pool.
Subclasses replace the decode and prefill parts with kernels (`_build_decodes`/`_decodes`,
`_build_prefills`/`_prefills`). An fp8 pool (`--kv-cache-dtype fp8`) is written and read through
kernels/attention/kv_fp8.py's reference with the layer's `k_scale` / `v_scale`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardserve.kernels.attention import kv_fp8
from shardserve.layers.attention.backend import AttentionBackend, AttentionSpec, CommonAttentionMetadata
from shardserve.utils import cdiv


@dataclass
class _Prefill:
    token_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor   # blocks holding the whole sequence so far (a view of the step's int32 table)


@dataclass
class _DecodeGroup:
    """Decodes of similar length, padded to the group's longest (padding costs a gather)."""

    rows: torch.Tensor | None  # which decode rows; None = all of them, in order
    blocks: torch.Tensor       # [B * max_blocks] flattened block tables
    valid: torch.Tensor        # [B, max_blocks * block_size] which key positions exist
    query_pos: torch.Tensor    # [B]


@dataclass
class TorchAttentionMetadata:
    slots: torch.Tensor                    # [T] slot of each new token (block * block_size + offset)
    block_size: int
    num_decodes: int
    decodes: object                        # what _build_decodes made: decode groups here
    prefills: list[_Prefill]
    prefill_batch: object = None           # what a subclass's _build_prefills made for its kernel

    # The torch backend's K/V write reads these; computed on first use (and from the slots as they
    # are then), so backends that write from the slots launch nothing for them.
    @functools.cached_property
    def write_blocks(self) -> torch.Tensor:
        return self.slots // self.block_size

    @functools.cached_property
    def write_offsets(self) -> torch.Tensor:
        return self.slots % self.block_size

    @property
    def has_prefills(self) -> bool:
        """A prefill graph's metadata lists no chunks (they change with every replay), only its batch."""
        return bool(self.prefills) or self.prefill_batch is not None


_GROUP_MIN = 16   # below this many decodes one padded batch is cheapest


def _decode_group(common: CommonAttentionMetadata, rows: list[int], device: torch.device,
                  all_rows: bool) -> _DecodeGroup:
    block_size = common.block_size
    lens_list = [common.seq_lens[r] for r in rows]
    max_blocks = cdiv(max(lens_list), block_size)
    index = torch.tensor(rows, device=device)
    blocks = common.block_tables[:, :max_blocks].index_select(0, index).long().reshape(-1)
    lens = torch.tensor(lens_list, device=device)
    valid = torch.arange(max_blocks * block_size, device=device).unsqueeze(0) < lens.unsqueeze(1)
    return _DecodeGroup(None if all_rows else index, blocks, valid, lens - 1)


class TorchAttentionBackend(AttentionBackend):
    """KV layout [2, num_kv_heads, num_blocks, block_size, head_dim]: heads outermost, so gathering
    a request's blocks of one head yields its keys as one contiguous [seq, head_dim] matrix, and a
    whole decode batch is a single batched matmul per layer."""

    name = "torch"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def zero_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
        if kv_fp8.is_fp8(kv_cache.dtype):   # torch fills no fp8 tensor; byte 0 is +0.0
            kv_cache = kv_cache.view(torch.uint8)
        kv_cache.index_fill_(kv_cache.dim() - 3, block_ids, 0)   # [..., blocks, block_size, head_dim]

    def build(self, common: CommonAttentionMetadata, device: torch.device) -> TorchAttentionMetadata:
        block_size = common.block_size
        d = common.num_decodes
        seq_lens = common.seq_lens
        prefills = []
        start = d
        for i in range(d, len(seq_lens)):
            nblocks = cdiv(seq_lens[i], block_size)
            prefills.append(_Prefill(start, common.query_lens[i], common.context_lens[i],
                                     common.block_tables[i, :nblocks]))
            start += common.query_lens[i]
        slots = common.slot_mapping
        return TorchAttentionMetadata(slots, block_size, d, self._build_decodes(common, device), prefills,
                                      self._build_prefills(common, prefills, device) if prefills else None)

    def _build_prefills(self, common: CommonAttentionMetadata, prefills: list[_Prefill],
                        device: torch.device) -> object:
        return None   # the per-request loop below needs nothing more

    def _build_decodes(self, common: CommonAttentionMetadata, device: torch.device) -> object:
        d = common.num_decodes
        if d < _GROUP_MIN:
            return [_decode_group(common, list(range(d)), device, all_rows=True)] if d else []
        # Four length buckets: far less padding to gather when lengths differ.
        seq_lens = common.seq_lens
        order = sorted(range(d), key=lambda r: seq_lens[r])
        size = cdiv(d, 4)
        return [_decode_group(common, order[i:i + size], device, all_rows=False) for i in range(0, d, size)]

    def forward(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: TorchAttentionMetadata, rotary=None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self._write(q, k, v, k_cache, v_cache, md, rotary, spec)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if md.num_decodes:
            self._decodes(spec, q, k_cache, v_cache, md, out)
        if md.has_prefills:
            self._prefills(spec, q, k, v, k_cache, v_cache, md, out)
        return out

    def _prefills(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, md: TorchAttentionMetadata, out: torch.Tensor) -> None:
        """Fill the prefill rows of out: one SDPA call per request."""
        for p in md.prefills:
            rows = slice(p.token_start, p.token_start + p.query_len)
            if p.context_len == 0 and spec.sliding_window is None and not kv_fp8.is_fp8(k_cache.dtype):
                out[rows] = _sdpa(q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
                                  spec, None).transpose(0, 1)
                continue
            kv_len = p.context_len + p.query_len
            keys = kv_fp8.load(_sequence(k_cache, p.block_ids, kv_len), spec.k_scale, q.dtype)
            values = kv_fp8.load(_sequence(v_cache, p.block_ids, kv_len), spec.v_scale, q.dtype)
            q_pos = torch.arange(p.context_len, kv_len, device=q.device)
            k_pos = torch.arange(kv_len, device=q.device)
            mask = _allowed(q_pos.unsqueeze(1), k_pos.unsqueeze(0), spec.sliding_window)
            out[rows] = _sdpa(q[rows].transpose(0, 1), keys, values, spec, mask).transpose(0, 1)

    def _write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               md: TorchAttentionMetadata, rotary, spec: AttentionSpec | None = None) -> None:
        """New tokens' K/V into the pool (and, in a backend that fuses it, the rotation first); an
        fp8 pool takes them divided by spec's scales."""
        k_scale, v_scale = (spec.k_scale, spec.v_scale) if spec is not None else (1.0, 1.0)
        k_cache[:, md.write_blocks, md.write_offsets] = kv_fp8.store(k.transpose(0, 1), k_cache.dtype, k_scale)
        v_cache[:, md.write_blocks, md.write_offsets] = kv_fp8.store(v.transpose(0, 1), v_cache.dtype, v_scale)

    def _decodes(self, spec: AttentionSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 md: TorchAttentionMetadata, out: torch.Tensor) -> None:
        """Fill out[:num_decodes], one row per decoding request."""
        for group in md.decodes:
            if group.rows is None:
                out[:md.num_decodes] = self._decode(spec, q[:md.num_decodes], k_cache, v_cache, group)
            else:
                out[group.rows] = self._decode(spec, q[group.rows], k_cache, v_cache, group)

    @staticmethod
    def _decode(spec: AttentionSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                md: _DecodeGroup) -> torch.Tensor:
        """A group of decodes in two batched matmuls: per KV head, each request's gathered keys are a
        contiguous [max_len, D] matrix (padding reads the zero null block and is masked)."""
        b, hk, group, dim = q.shape[0], spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
        length = md.valid.shape[1]
        keys = k_cache.index_select(1, md.blocks).view(hk * b, length, dim)
        values = v_cache.index_select(1, md.blocks).view(hk * b, length, dim)
        if kv_fp8.is_fp8(keys.dtype):   # widened to the activations' dtype with the layer's scales
            keys = kv_fp8.dequantize(keys, spec.k_scale, q.dtype)
            values = kv_fp8.dequantize(values, spec.v_scale, q.dtype)
        qh = (q.view(b, hk, group, dim).transpose(0, 1).reshape(hk * b, group, dim) * spec.scale).to(keys.dtype)
        scores = torch.bmm(qh, keys.transpose(1, 2)).float().view(hk, b, group, length)
        allowed = md.valid
        if spec.sliding_window is not None:
            k_pos = torch.arange(length, device=q.device).unsqueeze(0)
            allowed = allowed & (k_pos > md.query_pos.unsqueeze(1) - spec.sliding_window)
        scores.masked_fill_(~allowed[None, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype).view(hk * b, group, length)
        out = torch.bmm(probs, values).view(hk, b, group, dim).transpose(0, 1)   # [B, Hk, G, D]
        return out.reshape(b, spec.num_heads, dim).to(q.dtype)


def _sequence(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's keys (or values) as [Hk, length, D]."""
    blocks = cache.index_select(1, block_ids)                # [Hk, n, block_size, D]
    hk, n, block_size, dim = blocks.shape
    return blocks.view(hk, n * block_size, dim)[:, :length]


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
          mask: torch.Tensor | None) -> torch.Tensor:
    """q: [Hq, Tq, D], k/v: [Hk, Tk, D] -> [Hq, Tq, D]."""
    group = spec.num_heads // spec.num_kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=spec.scale)
