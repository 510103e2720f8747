"""Which q/k layouts the fused rotary kernels (native CPU and Triton) take. Plain Python, no Triton,
so the layers can ask on any machine."""
from __future__ import annotations

import torch


def heads_packed(*tensors: torch.Tensor) -> bool:
    """[T, H, D] views whose head rows are contiguous and back to back, as views of a fresh qkv
    are: what the fused rotary kernels (native and Triton) index."""
    return all(t.stride(-1) == 1 and t.stride(1) == t.shape[-1] for t in tensors)


def triton_tileable(head_dim: int) -> bool:
    """The Triton rotary kernels take a power-of-two half head as one tile."""
    half = head_dim // 2
    return half & (half - 1) == 0
