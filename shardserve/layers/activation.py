from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.layers import cpu_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [.., 2 * d] gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous() and cpu_ops.handles(x):
            return cpu_ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
