"""The attention module models use: holds its layer's KV cache and defers to the step's backend."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardserve.layers.attention.backend import AttentionBackend, AttentionSpec
from shardserve.layers.rotary import RotaryEmbedding


@dataclass
class AttentionContext:
    """Passed down the model each forward: the backend and its per-step metadata."""

    backend: AttentionBackend
    metadata: object


class Attention(nn.Module):
    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.spec = spec
        # Bound by the model runner once the KV pool is allocated; empty during weight loading.
        self.kv_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
                rotary: tuple[RotaryEmbedding, torch.Tensor] | None = None) -> torch.Tensor:
        """rotary: (rotary embedding, positions) to rotate q and k with first. A backend that can
        fuses the rotation into its K/V write (one kernel on CUDA); otherwise it is applied here."""
        if rotary is None:
            return ctx.backend.forward(self.spec, q, k, v, self.kv_cache, ctx.metadata)
        emb, positions = rotary
        if ctx.backend.fuses_rotary(q, k, v):
            return ctx.backend.forward(self.spec, q, k, v, self.kv_cache, ctx.metadata, (positions, emb.cos, emb.sin))
        q, k = emb(positions, q, k)
        return ctx.backend.forward(self.spec, q, k, v, self.kv_cache, ctx.metadata)
