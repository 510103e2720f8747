"""SiLU-and-mul for fused gate/up projections: the native CPU or Triton kernel where one takes the
tensor (layers/fused.py), else the torch reference."""
from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels.activation import reference
from shardserve.layers.fused import ops_for


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused [.., 2 * d] gate_up output (gate first)."""
    ops = ops_for(x) if x.is_contiguous() else None
    if ops is not None:
        return ops.silu_and_mul(x)
    return reference.silu_and_mul(x)


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [.., 2 * d] gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
