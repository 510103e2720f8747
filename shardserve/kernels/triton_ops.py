"""The fused small CUDA kernels behind one interface, the one kernels/cpu/cpu_ops.py also offers:
rms_norm (with the residual add), silu_and_mul and rotary_neox_ (layers/fused.py picks between the
two). Each module imports Triton only when its kernels are first built, so this imports anywhere."""
from __future__ import annotations

import functools
import importlib.util

import torch

from shardserve.kernels.activation.triton_activation import silu_and_mul
from shardserve.kernels.norm.triton_norm import rms_norm

__all__ = ["available", "handles", "rms_norm", "silu_and_mul", "rotary_neox_"]


@functools.cache
def available() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def handles(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors) and available()


def rotary_neox_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
    """NeoX-style rotation of q [T, Hq, D] and k [T, Hk, D] in place (head rows packed)."""
    from shardserve.kernels.rope import triton_rope  # imports Triton at module level
    triton_rope.rotary_neox_(positions, q, k, cos, sin)
