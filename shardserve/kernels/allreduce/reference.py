"""What the fused all-reduce + residual add + RMSNorm computes, in plain torch: the ranks' parts
summed in fp32 in rank order, added to the residual in the activations' dtype, then normed."""
from __future__ import annotations

import torch

from shardserve.kernels.norm.reference import rms_norm


def all_reduce_add_rms_norm(parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """parts: every rank's partial sum, in rank order. Returns (normed, new residual)."""
    total = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for part in parts:
        total += part.float()
    residual = (total.to(residual.dtype).float() + residual.float()).to(residual.dtype)
    return rms_norm(residual, weight, eps), residual
