"""SiLU-and-mul in plain torch: the path without fused kernels and their oracle."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for a fused [.., 2 * d] gate_up projection."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
