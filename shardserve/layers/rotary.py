"""Rotary position embeddings (neox / rotate-half layout, as HF Llama), with `llama3` and `linear`
rope scaling. cos/sin are precomputed once for every position up to max_position."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shardserve.kernels.cpu import cpu_ops
from shardserve.kernels.rope.layout import heads_packed, triton_tileable
from shardserve.kernels.rope.reference import rotate_neox
from shardserve.layers.fused import ops_for


def _inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # float32 throughout, as HF computes it, so bf16 results match the reference bit for bit.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None, freq_factors: list[float] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, base, rope_scaling)
        if freq_factors is not None:   # GGUF's rope_freqs tensor: divisors per frequency
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)   # [max_pos, head_dim / 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]. Returns rotated (q, k) in their dtype; on the
        fused kernels (native on the CPU, Triton on CUDA), q and k are rotated in place (they are
        views of a fresh qkv)."""
        ops = ops_for(q, k, self.cos)
        if ops is not None and heads_packed(q, k) and (ops is cpu_ops or triton_tileable(q.shape[-1])):
            ops.rotary_neox_(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)
