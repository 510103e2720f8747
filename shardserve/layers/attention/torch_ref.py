"""Paged attention in plain torch: correct on CPU and CUDA, and the oracle for faster kernels.

Decodes are batched: every decode request's keys are gathered through its block table into one
padded [B, max_len] tensor (padding points at the zero null block and is masked). Prefill chunks
are handled one request at a time with torch's SDPA, reading any cached prefix from the pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardserve.layers.attention.backend import AttentionBackend, AttentionSpec, CommonAttentionMetadata


@dataclass
class _Prefill:
    token_start: int
    query_len: int
    context_len: int
    kv_slots: torch.Tensor   # [context_len + query_len] slots of the whole sequence so far


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_slots: torch.Tensor | None      # [B, max_len]
    decode_valid: torch.Tensor | None      # [B, max_len] bool
    decode_positions: torch.Tensor | None  # [B, max_len] key positions (for sliding windows)
    decode_query_pos: torch.Tensor | None  # [B]
    prefills: list[_Prefill]


def _slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    blocks = torch.gather(block_tables.long(), 1, positions // block_size)
    return blocks * block_size + positions % block_size


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build(self, common: CommonAttentionMetadata, device: torch.device) -> TorchAttentionMetadata:
        bs = common.block_size
        d = common.num_decodes
        seq_lens = common.seq_lens
        decode_slots = decode_valid = decode_pos = decode_qpos = None
        if d:
            max_len = max(seq_lens[:d])
            lens = torch.tensor(seq_lens[:d], device=device)
            pos = torch.arange(max_len, device=device).expand(d, max_len)
            decode_valid = pos < lens.unsqueeze(1)
            decode_slots = _slots(common.block_tables[:d], pos, bs).masked_fill(~decode_valid, 0)
            decode_pos, decode_qpos = pos, lens - 1
        prefills = []
        start = d
        for i in range(d, len(seq_lens)):
            pos = torch.arange(seq_lens[i], device=device).unsqueeze(0)
            slots = _slots(common.block_tables[i:i + 1], pos, bs)[0]
            prefills.append(_Prefill(start, common.query_lens[i], common.context_lens[i], slots))
            start += common.query_lens[i]
        return TorchAttentionMetadata(common.slot_mapping, d, decode_slots, decode_valid, decode_pos,
                                      decode_qpos, prefills)

    def forward(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: TorchAttentionMetadata) -> torch.Tensor:
        k_pool = kv_cache[0].view(-1, spec.num_kv_heads, spec.head_dim)
        v_pool = kv_cache[1].view(-1, spec.num_kv_heads, spec.head_dim)
        k_pool.index_copy_(0, md.slot_mapping, k)
        v_pool.index_copy_(0, md.slot_mapping, v)
        out = torch.empty_like(q)
        if md.num_decodes:
            out[:md.num_decodes] = self._decode(spec, q[:md.num_decodes], k_pool, v_pool, md)
        for p in md.prefills:
            rows = slice(p.token_start, p.token_start + p.query_len)
            if p.context_len == 0 and spec.sliding_window is None:
                out[rows] = _sdpa(q[rows], k[rows], v[rows], spec, None)
            else:
                keys, values = k_pool[p.kv_slots], v_pool[p.kv_slots]
                q_pos = torch.arange(p.context_len, p.context_len + p.query_len, device=q.device)
                k_pos = torch.arange(len(p.kv_slots), device=q.device)
                mask = _allowed(q_pos.unsqueeze(1), k_pos.unsqueeze(0), spec.sliding_window)
                out[rows] = _sdpa(q[rows], keys, values, spec, mask)
        return out

    @staticmethod
    def _decode(spec: AttentionSpec, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                md: TorchAttentionMetadata) -> torch.Tensor:
        b = q.shape[0]
        group = spec.num_heads // spec.num_kv_heads
        keys = k_pool[md.decode_slots].float()      # [B, L, Hk, D]
        values = v_pool[md.decode_slots].float()
        qg = q.float().view(b, spec.num_kv_heads, group, spec.head_dim)
        scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) * spec.scale
        allowed = md.decode_valid
        if spec.sliding_window is not None:
            allowed = allowed & _allowed(md.decode_query_pos.unsqueeze(1), md.decode_positions,
                                         spec.sliding_window)
        scores.masked_fill_(~allowed[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        out = torch.einsum("bhgl,blhd->bhgd", probs, values)
        return out.reshape(b, spec.num_heads, spec.head_dim).to(q.dtype)


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
          mask: torch.Tensor | None) -> torch.Tensor:
    """q: [Tq, Hq, D], k/v: [Tk, Hk, D] -> [Tq, Hq, D]."""
    group = spec.num_heads // spec.num_kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, is_causal=mask is None, scale=spec.scale)
    return out.transpose(0, 1)
