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

Quantized weights: while a model is built inside `linear_methods(factory)` (models/loader.py, with a
factory from the quantization room), each layer asks the factory for a `LinearMethod`, which
registers the layer's parameters (`register_weight`, `register_quant_param`), converts them after
loading and does the layer's matmul. Parameters say which of their dims are the output and input
features (`output_dim`, `input_dim`; None: not split) and whether one is packed (`packed_dim`,
`pack_factor` values per element), so the same loaders shard them; a `per_part` parameter holds one
value per fused part (q/k/v, gate/up).

Partial sums (the deferred TP reduction): `RowParallelLinear.forward(x, partial_sum=True)` returns
this rank's unreduced output, and the RMSNorm that comes next takes it with `partial_sum=True` and
all-reduces it there, in one kernel with the residual add and the norm where it can
(distributed/fused_allreduce.py). The two calls of a pair always say the same; the model decides
once per layer whether its pairs use it (`supports_partial_sum`: TP > 1 and no bias).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.comm import partial_sum_matmul, tensor_model_parallel_all_reduce
from shardserve.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from shardserve.kernels.cpu import cpu_ops
from shardserve.kernels.cpu.decoder_stack import StackLinear, panels_linear
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


class LinearMethod(ABC):
    """How a linear layer of one weight format stores, loads and multiplies its weight; the
    quantization room implements one per format. Unquantized layers have none."""

    @abstractmethod
    def create_weights(self, layer: "LinearBase") -> None:
        """Register the layer's parameters (layer.register_weight / register_quant_param)."""

    def process_after_loading(self, layer: "LinearBase") -> None:
        """Convert the loaded parameters to the form `apply` runs on (once, after loading)."""

    @abstractmethod
    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's output for x (with the bias, where given)."""

    def apply_gated(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for a merged [gate, up] layer without bias in one kernel, or None where
        this format has no such kernel for x (then: apply, then SiLU-and-mul)."""
        return None

    def takes_fp8_rows(self, layer: "LinearBase", x: torch.Tensor) -> bool:
        """Whether `apply` would quantize x to FP8 per token first; if so it also takes those rows
        made by the kernel before it (`Fp8Rows`: the norm's or SiLU-and-mul's, which quantizes its
        own output instead of writing it out). x: the input, or a tensor with its rows, dtype and
        device (the gate_up output SiLU-and-mul makes the input from)."""
        return False

    def stack_linear(self, layer: "LinearBase", gated: bool) -> StackLinear | None:
        """The native CPU kernel call that `apply` (gated: `apply_gated`) makes for fp32 CPU rows, for
        the decoder stack run in one call (kernels/cpu/decoder_stack.py); None where there is none."""
        return None


_METHOD_FACTORY: Callable[[nn.Module], object | None] | None = None   # layers/moe.py asks it too


@contextmanager
def linear_methods(factory: Callable[["LinearBase"], LinearMethod | None] | None) -> Iterator[None]:
    """Layers built inside get their LinearMethod from `factory` (None: unquantized)."""
    global _METHOD_FACTORY
    old, _METHOD_FACTORY = _METHOD_FACTORY, factory
    try:
        yield
    finally:
        _METHOD_FACTORY = old


def quant_method_for(layer: nn.Module) -> object | None:
    """What the current factory gives `layer`: a LinearMethod, a MoEMethod for a MoE layer's experts
    (layers/moe.py), for an LM head a LinearMethod where the format quantizes it (layers/vocab.py),
    or None (unquantized, or built outside `linear_methods`)."""
    return _METHOD_FACTORY(layer) if _METHOD_FACTORY is not None else None


def process_weights_after_loading(model: nn.Module, skip: Iterable[nn.Module] = ()) -> None:
    """skip: modules already processed (offloaded layers, layers/cpu_offload.py), with their children."""
    done = {id(m) for module in skip for m in module.modules()}
    for module in model.modules():
        if getattr(module, "quant_method", None) is not None and id(module) not in done:
            module.quant_method.process_after_loading(module)


class LinearBase(nn.Module):
    packed_weight_layout = "packed"   # how cpu_ops.pack_weights may store the weight
    quantizable = True                # False: never quantized (a MoE router)

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 output_shard_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.output_shard_sizes = output_shard_sizes or [output_size]   # this rank's rows of each fused part
        self.params_dtype = torch.get_default_dtype()
        factory = _METHOD_FACTORY if self.quantizable else None
        self.quant_method = factory(self) if factory is not None else None
        if self.quant_method is None:
            self.register_weight(torch.empty(output_size, input_size))
        else:
            self.quant_method.create_weights(self)
        if bias:
            self.bias = _set_loader(nn.Parameter(torch.empty(output_size), requires_grad=False), self.weight_loader)
            self.bias.output_dim, self.bias.input_dim = 0, None
        else:
            self.register_parameter("bias", None)

    def register_weight(self, weight: torch.Tensor) -> None:
        self.register_quant_param("weight", weight, output_dim=0, input_dim=1)

    def requantize(self, method: LinearMethod | None) -> None:
        """Another format for this layer, before any weight loads: the one its checkpoint stores it in
        where that is not the one it was built in (models/loader.place_schemes); None: a plain layer.
        The format's tensors go; the bias stays."""
        device = next(p.device for p in self.parameters())
        for name in [n for n in self._parameters if n != "bias"]:
            del self._parameters[name]
        for name in [n for n, b in self._buffers.items() if hasattr(b, "weight_loader")]:   # optional scales
            del self._buffers[name]
        self.quant_method = method
        with torch.device(device):
            if method is None:
                self.register_weight(torch.empty(self.output_size, self.input_size, dtype=self.params_dtype))
            else:
                method.create_weights(self)

    def register_quant_param(self, name: str, data: torch.Tensor, output_dim: int | None = 0,
                             input_dim: int | None = None, per_part: bool = False, packed_dim: int | None = None,
                             pack_factor: int = 1, full_precision: bool = False) -> nn.Parameter:
        """full_precision: the loader must not round the checkpoint's values to the model dtype first
        (a quantization scale)."""
        param = _set_loader(nn.Parameter(data, requires_grad=False), self.weight_loader)
        param.output_dim, param.input_dim, param.per_part = output_dim, input_dim, per_part
        param.full_precision = full_precision
        param.packed_dim, param.pack_factor = packed_dim, pack_factor
        self.register_parameter(name, param)
        return param

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """LinearMethod.takes_fp8_rows for this layer (False for unquantized ones)."""
        return self.quant_method is not None and self.quant_method.takes_fp8_rows(self, x)

    def stack_linear(self, gated: bool = False) -> StackLinear | None:
        """This layer's matmul on fp32 CPU rows as one native kernel call (kernels/cpu/decoder_stack.py),
        or None where it is not one. gated: the call `silu_and_mul` makes where it is one kernel."""
        if self.quant_method is not None:
            return self.quant_method.stack_linear(self, gated)
        return None if gated else panels_linear(self.weight, self.output_size, self.input_size, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if getattr(param, "per_part", False):
            param.data[0].copy_(loaded.reshape(()))
            return
        default_weight_loader(param, loaded)

    # ---- slicing a checkpoint tensor along a parameter's output dim (column-parallel layers) ------
    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, offset: int, size: int, rank: int) -> None:
        """Fill `size` logical output rows of `param` from `offset` with the checkpoint tensor's rows
        rank * size onwards (in the param's packed units where its output dim is packed)."""
        dim = getattr(param, "output_dim", 0)
        if dim is None:   # not split over outputs (a per-tensor scale): every rank holds it whole
            default_weight_loader(param, loaded)
            return
        factor = param.pack_factor if getattr(param, "packed_dim", None) == dim else 1
        offset, size = offset // factor, size // factor
        default_weight_loader(param.data.narrow(dim, offset, size), loaded.narrow(dim, rank * size, size))


class ReplicatedLinear(LinearBase):
    quantizable = False   # the routers that use it stay in full precision, as every format leaves them


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 output_shard_sizes: list[int] | None = None) -> None:
        tp = get_tensor_model_parallel_world_size()
        super().__init__(input_size, _divide(output_size, tp, "output features"), bias, output_shard_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if getattr(param, "per_part", False):
            param.data[0].copy_(loaded.reshape(()))
            return
        self._load_rows(param, loaded, 0, self.output_size, self.tp_rank)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = get_tensor_model_parallel_world_size()
        super().__init__(_divide(input_size, tp, "input features"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if getattr(param, "per_part", False):
            param.data[0].copy_(loaded.reshape(()))
            return
        dim = getattr(param, "input_dim", None)
        if dim is not None:   # the bias and per-output-channel scales are replicated
            size = param.shape[dim]   # in the param's own units (packed, or groups), like the checkpoint's
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        default_weight_loader(param, loaded)

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
            # The fused path sends the matmul's output to the peers itself: plain weights only.
            sent = partial_sum_matmul(x, self.weight) if self.quant_method is None else None
            return sent if sent is not None else self.matmul(x)
        out = self.matmul(x)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        if self.bias is not None:
            out = out + self.bias   # once, after the reduction
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs of several logical matrices stacked: shard_id indexes them."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        tp = get_tensor_model_parallel_world_size()
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias,
                         [_divide(s, tp, "output features") for s in output_sizes])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if getattr(param, "per_part", False):
            param.data[shard_id].copy_(loaded.reshape(()))
            return
        per_rank = self.output_shard_sizes
        self._load_rows(param, loaded, sum(per_rank[:shard_id]), per_rank[shard_id], self.tp_rank)

    def silu_and_mul(self, x: torch.Tensor, quant_for: "LinearBase | None" = None) -> torch.Tensor:
        """silu(gate) * up for a [gate, up] pair of equal sizes: [tokens, input_size] -> [tokens,
        output_size / 2]. A few rows on CUDA (no bias; plain weights, or a format whose method has a
        gated kernel): one Triton kernel for both matmuls and the activation; otherwise this layer's
        matmul, then SiLU-and-mul. quant_for: the layer that takes the result (down_proj), to which
        SiLU-and-mul may hand FP8 rows (layers/activation.py)."""
        if self.bias is None and self.quant_method is None and triton_gemv.handles(x, self.weight):
            return triton_gemv.gemv(x, self.weight, gated=True)
        if self.bias is None and self.quant_method is not None:
            out = self.quant_method.apply_gated(self, x)
            if out is not None:
                return out
        return silu_and_mul(self(x), quant_for)


class QKVParallelLinear(ColumnParallelLinear):
    _PARTS = {"q": 0, "k": 1, "v": 2}

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
        LinearBase.__init__(self, hidden_size, out, bias, [self.q_size, self.kv_size, self.kv_size])

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if getattr(param, "per_part", False):
            param.data[self._PARTS[shard_id]].copy_(loaded.reshape(()))
            return
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        self._load_rows(param, loaded, offset, size, rank)
