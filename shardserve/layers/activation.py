from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels.activation import reference
from shardserve.layers.fused import ops_for


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [.., 2 * d] gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = ops_for(x) if x.is_contiguous() else None
        if ops is not None:
            return ops.silu_and_mul(x)
        return reference.silu_and_mul(x)
