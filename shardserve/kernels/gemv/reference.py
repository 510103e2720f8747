"""What the skinny Triton matmul computes, in plain torch (cuBLAS on a GPU): its oracle."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         gated: bool = False) -> torch.Tensor:
    """x @ weight^T (+ bias); gated: silu(x Wg^T) * (x Wu^T) for a stacked [2 * n, k] gate_up weight,
    with the intermediate rounded to x's dtype as the unfused path rounds it."""
    y = F.linear(x, weight, bias)
    if not gated:
        return y
    n = weight.shape[0] // 2
    return F.silu(y[..., :n]) * y[..., n:]
