"""The attention backend interface.

A step's tokens arrive flattened: all decode tokens first (one per request), then the prefill
chunks. `CommonAttentionMetadata` describes the batch once per step, in backend-neutral terms
(block tables, sequence lengths, slot mapping); each backend turns it into whatever its kernels
need with `build`, once per step, and every layer reuses that.

Each backend chooses its KV cache layout per layer (`kv_cache_shape`), K then V on dim 0. A token at
position p of a request lives in slot block_table[p // block_size] * block_size + p % block_size.
Block 0 is the null block: zero, never written, the target of padding.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    num_decodes: int                 # requests with exactly one new token, placed first
    query_lens: list[int]            # per request, new tokens this step
    context_lens: list[int]          # per request, tokens already in the KV cache
    block_tables: torch.Tensor       # [num_reqs, max_blocks] int32, padded with 0 (null block)
    slot_mapping: torch.Tensor       # [num_tokens] int64: where each new token's K/V goes
    block_size: int

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]


@dataclass
class AttentionSpec:
    """Static per-layer facts a backend may need."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    # An fp8 KV pool holds k / k_scale and v / v_scale (vLLM's per-layer scales; 1.0 unless the
    # checkpoint gives them, see layer.py). Other pools ignore them.
    k_scale: float = 1.0
    v_scale: float = 1.0


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's KV tensor; dim 0 is K/V, the rest is the backend's choice."""

    @abstractmethod
    def zero_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Clear blocks about to be handed to a request, so slots it has not written yet hold zeros
        (a stale NaN would survive a zero attention weight: 0 * NaN = NaN). kv_cache is one layer's
        cache or several stacked on new leading dims."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata, device: torch.device) -> object:
        """Per-step metadata shared by all layers."""

    def fuses_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Can `forward` rotate q and k itself (its `rotary` argument) for these tensors?"""
        return False

    @abstractmethod
    def forward(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: object, rotary=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] for the new tokens. Writes k, v into kv_cache at the slot
        mapping, attends over each request's whole context, returns [T, Hq, D] (in `out` if given).
        rotary, only where `fuses_rotary` said so: (positions [T], cos, sin [max_position, D / 2])
        to rotate q and k (NeoX layout) in place before anything else."""
