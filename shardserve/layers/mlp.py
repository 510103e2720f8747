"""The gated MLP of Llama and most families since: down(silu(gate(x)) * up(x))."""
from __future__ import annotations

import torch
from torch import nn

from shardserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """gate and up as one column-parallel matmul (`gate_up_proj`, checkpoint's gate_proj/up_proj
    stacked), down row-parallel (`down_proj`). Which kernels run is the linears' choice."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    @property
    def supports_partial_sum(self) -> bool:
        return self.down_proj.supports_partial_sum

    def forward(self, x: torch.Tensor, partial_sum: bool = False) -> torch.Tensor:
        """partial_sum: leave down_proj's output as this rank's partial sum for the next norm
        (layers/linear.py's module docstring)."""
        return self.down_proj(self.gate_up_proj.silu_and_mul(x, quant_for=self.down_proj), partial_sum=partial_sum)
