"""RMSNorm computed in fp32, with the residual add fused into the same call (vLLM's shape).

With tensor parallelism the norm is also where a row-parallel layer's partial sum gets all-reduced
(`partial_sum=True`, layers/linear.py's module docstring): the reduction, the residual add and the
norm run as one kernel where distributed/fused_allreduce.py can, else one after the other."""
from __future__ import annotations

import torch
from torch import nn

from shardserve.distributed import comm
from shardserve.kernels.norm import reference
from shardserve.layers.fused import ops_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return reference.rms_norm(x, self.weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, partial_sum: bool = False):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual).
        partial_sum: x is a TP rank's partial sum (RowParallelLinear(partial_sum=True)), all-reduced
        first (in the same kernel where it can)."""
        if partial_sum and not comm.take_reduced(x):   # (the matmul that made x may have all-reduced it)
            out = comm.fused_all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
            if out is not None:
                return out, residual
            x = comm.tensor_model_parallel_all_reduce(x)
        ops = ops_for(x, self.weight) if x.is_contiguous() else None
        if ops is not None:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            if residual.is_contiguous() and ops_for(residual) is ops:
                residual = residual.clone() if residual is x else residual
                return ops.rms_norm(x, self.weight, self.eps, residual), residual   # residual += x in place
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
