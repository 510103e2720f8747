"""Rotary embedding (NeoX / rotate-half layout) in plain torch, as HF computes it: the path without
fused kernels and their oracle."""
from __future__ import annotations

import torch


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated by cos/sin [..., D / 2], computed in x's dtype (cos/sin cast down first)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
