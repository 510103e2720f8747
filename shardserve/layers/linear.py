"""Linear layers that know how they are sharded (Megatron style).

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies in only
this rank's slice, so a checkpoint tensor is read once and no rank ever holds the full matrix.
- ColumnParallelLinear: output features split across TP ranks; no communication.
- RowParallelLinear: input features split; partial sums all-reduced; bias added once, after it.
- MergedColumnParallelLinear: several column layers fused into one matmul (gate_up_proj), with
  the gated form `silu_and_mul(x)` for a [gate, up] pair.
- QKVParallelLinear: q, k and v fused; KV heads are replicated when TP exceeds their count.

Each layer picks its matmul kernel (`linear()`): packed native CPU panels, the Triton
skinny-matmul for a few rows on CUDA, else F.linear. Models never call kernels themselves.

Partial sums (the deferred TP reduction): `RowParallelLinear.forward(x, partial_sum=True)` returns
this rank's unreduced output, and the RMSNorm that comes next takes it with `partial_sum=True` and
all-reduces it there, in one kernel with the residual add and the norm where it can
(distributed/fused_allreduce.py). The two calls of a pair always say the same; the model decides
once per layer whether its pairs use it (`supports_partial_sum`: TP > 1 and no bias).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.comm import partial_sum_matmul, tensor_model_parallel_all_reduce
from shardserve.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from shardserve.kernels.cpu import cpu_ops
from shardserve.kernels.gemv import triton_gemv
from shardserve.layers.activation import silu_and_mul


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def _set_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader
    return param


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except for weights packed for the native CPU kernel (cpu_ops.pack_weights) and
    a few rows on CUDA (a weight-streaming Triton kernel, kernels/gemv/triton_gemv.py)."""
    if weight.dim() == 3:
        return cpu_ops.linear_packed(x, weight, bias)
    if triton_gemv.handles(x, weight):
        return triton_gemv.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class LinearBase(nn.Module):
    packed_weight_layout = "packed"   # how cpu_ops.pack_weights may store the weight

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.weight = _set_loader(nn.Parameter(torch.empty(output_size, input_size), requires_grad=False),
                                  self.weight_loader)
        if bias:
            self.bias = _set_loader(nn.Parameter(torch.empty(output_size), requires_grad=False),
                                    self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = get_tensor_model_parallel_world_size()
        super().__init__(input_size, _divide(output_size, tp, "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = get_tensor_model_parallel_world_size()
        super().__init__(_divide(input_size, tp, "input features"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 2:
            size = param.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * size, size)
        default_weight_loader(param, loaded)   # the bias is replicated

    @property
    def supports_partial_sum(self) -> bool:
        """Whether forward(x, partial_sum=True) is worth it and allowed: TP > 1 (else the sum is
        already whole) and no bias (added once, after the reduction, so not to a partial sum)."""
        return self.tp_size > 1 and self.bias is None

    def forward(self, x: torch.Tensor, partial_sum: bool = False) -> torch.Tensor:
        """x [tokens, input_size / TP] -> [tokens, output_size], all-reduced over TP with the bias.
        partial_sum=True: this rank's partial sum instead (no bias), which the next RMSNorm must take
        with partial_sum=True (the module docstring says why)."""
        if partial_sum:
            assert self.bias is None, "a partial sum cannot take the bias (it is added once, after the reduction)"
            sent = partial_sum_matmul(x, self.weight)   # also sent to the peers, where the fused path runs
            return sent if sent is not None else linear(x, self.weight)
        out = linear(x, self.weight)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        if self.bias is not None:
            out = out + self.bias   # once, after the reduction
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs of several logical matrices stacked: shard_id indexes them."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        per_rank = [s // self.tp_size for s in self.output_sizes]
        offset = sum(per_rank[:shard_id])
        size = per_rank[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for a [gate, up] pair of equal sizes: [tokens, input_size] -> [tokens,
        output_size / 2]. A few rows on CUDA (no bias): one Triton kernel for both matmuls and the
        activation; otherwise this layer's matmul, then SiLU-and-mul."""
        if self.bias is None and triton_gemv.handles(x, self.weight):
            return triton_gemv.gemv(x, self.weight, gated=True)
        return silu_and_mul(self(x))


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        else:   # fewer KV heads than ranks: each KV head is replicated on tp / num_kv_heads ranks
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp, num_kv_heads, "tensor_parallel_size / num_key_value_heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size))
