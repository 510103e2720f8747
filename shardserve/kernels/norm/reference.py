"""RMSNorm in plain torch, as HF computes it (fp32 inside, rounded to the input's dtype before the
weight): the CPU path without native kernels and the oracle the Triton and C kernels are tested
against."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)
