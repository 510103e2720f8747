"""Which fused implementation of the small layers (RMSNorm + residual, SiLU-and-mul, rotary) takes
given tensors: the native CPU kernels for fp32 CPU activations, Triton on CUDA, else None (the
layers' own torch code). Both modules expose the same three functions."""
from __future__ import annotations

import torch

from shardserve.kernels import triton_ops
from shardserve.kernels.cpu import cpu_ops


def ops_for(*tensors: torch.Tensor):
    if cpu_ops.handles(*tensors):
        return cpu_ops
    if triton_ops.handles(*tensors):
        return triton_ops
    return None
