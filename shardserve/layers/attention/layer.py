"""The attention module models use: holds its layer's KV cache (and the scales of an fp8 one) and
defers to the step's backend."""
from __future__ import annotations

import functools
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
        # vLLM's per-layer KV-cache scales, which FP8 checkpoints may carry (the model maps their
        # names here, quantization/kv_scales.py): optional buffers the loader fills when present,
        # mirrored into spec's floats, which the backends read for an fp8 pool. 1.0 otherwise.
        self.scales_loaded: set[str] = set()
        for name in ("k_scale", "v_scale"):
            scale = torch.full((), getattr(spec, name), dtype=torch.float32)
            # Not a bound method: the buffer would then hold the layer (a cycle that keeps the model
            # and its KV pool alive until the garbage collector runs).
            scale.weight_loader = functools.partial(_load_scale, name, spec, self.scales_loaded)
            scale.full_precision = True   # never rounded to the model's dtype
            self.register_buffer(name, scale, persistent=False)

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


def _load_scale(name: str, spec: AttentionSpec, loaded_names: set[str], buffer: torch.Tensor, loaded: torch.Tensor,
                shard_id=None) -> None:
    """A per-tensor KV-cache scale ([] or [1]; the largest, if a checkpoint gives several)."""
    value = float(loaded.float().max())
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"KV-cache {name} {value} is not a positive finite number")
    buffer.fill_(value)
    setattr(spec, name, value)
    loaded_names.add(name)
