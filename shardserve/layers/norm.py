"""RMSNorm computed in fp32, with the residual add fused into the same call (vLLM's shape).

With tensor parallelism the norm is also where a row-parallel layer's partial sum gets all-reduced
(`partial_sum=True`, layers/linear.py's module docstring): the reduction, the residual add and the
norm run as one kernel where distributed/fused_allreduce.py can, else one after the other."""
from __future__ import annotations

import torch
from torch import nn

from shardserve.distributed import comm
from shardserve.kernels.norm import reference, triton_norm
from shardserve.layers.fused import ops_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return reference.rms_norm(x, self.weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, partial_sum: bool = False,
                quant_for=None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual).
        partial_sum: x is a TP rank's partial sum (RowParallelLinear(partial_sum=True)), all-reduced
        first (in the same kernel where it can). quant_for: the linear layer that takes the norm
        next; where it would quantize it per token to FP8 first (LinearBase.takes_fp8_rows), the
        Triton kernel does so itself and the norm comes back as Fp8Rows."""
        if partial_sum and not comm.take_reduced(x):   # (the matmul that made x may have all-reduced it)
            out = comm.fused_all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
            if out is not None:
                return out, residual
            x = comm.tensor_model_parallel_all_reduce(x)
        if quant_for is not None and self._fp8_out(x, residual, quant_for):
            if residual is None:
                return triton_norm.rms_norm(x, self.weight, self.eps, quantize=True)
            residual = residual.clone() if residual is x else residual
            return triton_norm.rms_norm(x, self.weight, self.eps, residual, quantize=True), residual
        ops = ops_for(x, self.weight) if x.is_contiguous() or _heads_in_rows(x, residual) else None
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

    @staticmethod
    def _fp8_out(x: torch.Tensor, residual: torch.Tensor | None, quant_for) -> bool:
        """Whether the norm hands quant_for FP8 rows (takes_fp8_rows also checks that x is 2-D on CUDA,
        and answers first, and cheaply, for every unquantized layer)."""
        return (quant_for.takes_fp8_rows(x) and x.is_contiguous()
                and (residual is None or residual.is_contiguous()))


def _heads_in_rows(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """x is [T, heads, D] with each row's heads packed (q or k inside a fused qkv row, Qwen3's per-head
    norms), which the native CPU norm and the Triton one take without a copy."""
    return residual is None and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector whose features are split across the TP ranks by heads (OLMoE's q and k
    norms span all heads): each rank sums its squares, the sums are all-reduced, and each rank
    scales its own slice. `replicas`: how many ranks hold the same slice (KV heads replicated when
    TP exceeds them), whose sums the all-reduce would otherwise count that many times."""

    def __init__(self, full_size: int, shard: int, num_shards: int, eps: float, replicas: int = 1) -> None:
        super().__init__()
        self.full_size, self.shard, self.replicas, self.eps = full_size, shard, replicas, eps
        self.weight = nn.Parameter(torch.ones(full_size // num_shards))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.shard * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        squares = x.pow(2).sum(-1, keepdim=True)
        if self.full_size != x.shape[-1]:
            squares = comm.tensor_model_parallel_all_reduce(squares) / self.replicas
        return self.weight * (x * torch.rsqrt(squares / self.full_size + self.eps)).to(dtype)
