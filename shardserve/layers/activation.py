"""SiLU-and-mul for fused gate/up projections: the native CPU or Triton kernel where one takes the
tensor (layers/fused.py), else the torch reference; before an FP8 matmul, Triton's with the
per-token quantization inside."""
from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels.activation import reference, triton_activation
from shardserve.layers.fused import ops_for


def silu_and_mul(x: torch.Tensor, quant_for=None):
    """silu(gate) * up for a fused [.., 2 * d] gate_up output (gate first). quant_for: the linear
    layer that takes the result; where it would quantize it per token to FP8 first
    (LinearBase.takes_fp8_rows), the Triton kernel does so itself and returns Fp8Rows."""
    if quant_for is not None and x.is_contiguous() and quant_for.takes_fp8_rows(x):
        return triton_activation.silu_and_mul(x, quantize=True)
    ops = ops_for(x) if x.is_contiguous() else None
    if ops is not None:
        return ops.silu_and_mul(x)
    return reference.silu_and_mul(x)


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [.., 2 * d] gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
