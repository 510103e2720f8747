"""INT8 weights from compressed-tensors checkpoints (llm-compressor's W8A8 and W8A16: RedHatAI's
`*-quantized.w8a8` and `*-quantized.w8a16` models), widened once after loading into an ordinary
weight of the compute dtype, on every device.

So an INT8 checkpoint serves with the accuracy of its INT8 values, not with INT8's memory saving or
speed: no INT8 kernel is built (the GPUs' INT8 tensor-core matmuls, an INT8 GEMV like the FP8 one)
and the engine holds the weights at 2 bytes each (the planner counts them so). The activations are
not rounded to INT8 (W8A16 on W8A8 checkpoints too): the checkpoint's per-token dynamic scales, or
its static `input_scale` (read, not used), only ever lose accuracy against 16-bit activations, as
quantization/fp8.py says of FP8's.

What the library stores, per linear (the `weight_*` names as it writes them):
- `int-quantized`: `weight` int8 [N, K]; `weight_scale` per output channel [N, 1], per group of inputs
  [N, K / group] or per tensor [1] (one per fused q / k / v and gate / up part); `weight_zero_point`
  int8 of the scale's shape when the scheme is asymmetric; `input_scale` [1] with static activations.
- `pack-quantized` (8 bits, symmetric: the W8A16 preset, groups of 128): `weight_packed` int32
  [N, K / 4], four values per word, low byte first, each stored as value + 128; `weight_shape`; scales
  as above.
w[n, k] = (q[n, k] - zero) * scale."""
from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels.cpu.decoder_stack import StackLinear, panels_linear
from shardserve.layers.linear import LinearBase, LinearMethod, RowParallelLinear, linear

PACK = 4            # 8-bit values per int32 word (pack-quantized)
PACKED_OFFSET = 128  # pack-quantized stores value + 128 (unsigned bytes)


def unpack_int8(words: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 4] -> int16 [N, K]: each word's four bytes, low byte first, less the offset."""
    data = words.contiguous()
    n = data.shape[0]
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=data.device)
    values = (data.unsqueeze(-1) >> shifts) & 0xFF
    return values.reshape(n, -1).to(torch.int16) - PACKED_OFFSET


def _read_as_nothing(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """`weight_shape`, the tensor's original shape: the other tensors' shapes say it already."""


class Int8LinearMethod(LinearMethod):
    def __init__(self, strategy: str, symmetric: bool, packed: bool, group_size: int | None = None) -> None:
        self.strategy = strategy         # tensor (one scale per fused part) | channel | group
        self.group_size = group_size
        self.symmetric = symmetric
        self.packed = packed             # pack-quantized (else int-quantized)

    def create_weights(self, layer: LinearBase) -> None:
        n, k, parts = layer.output_size, layer.input_size, len(layer.output_shard_sizes)
        if self.strategy == "group":   # every rank keeps every group's scales (a row-parallel rank's
            # inputs need not start on a group boundary); process_after_loading picks its inputs' groups
            k_full = k * (layer.tp_size if isinstance(layer, RowParallelLinear) else 1)
            groups = -(-k_full // self.group_size)
        if self.packed:
            layer.register_quant_param("weight_packed", torch.empty(n, k // PACK, dtype=torch.int32), output_dim=0,
                                       input_dim=1, packed_dim=1, pack_factor=PACK)
            layer.register_quant_param("weight_shape", torch.zeros(2, dtype=torch.int64),
                                       output_dim=None).weight_loader = _read_as_nothing
        else:
            layer.register_weight(torch.empty(n, k, dtype=torch.int8))
        for name, dtype in (("weight_scale", torch.float32), ("weight_zero_point", torch.int8)):
            if name == "weight_zero_point" and self.symmetric:
                continue
            if self.strategy == "group":
                layer.register_quant_param(name, torch.zeros(n, groups, dtype=dtype), output_dim=0,
                                           full_precision=True)
            elif self.strategy == "channel":
                layer.register_quant_param(name, torch.zeros(n, 1, dtype=dtype), output_dim=0, full_precision=True)
            else:
                layer.register_quant_param(name, torch.zeros(parts, dtype=dtype), output_dim=None, per_part=True,
                                           full_precision=True)
        # A static input_scale per part: optional (dynamic schemes carry none), read and dropped.
        buf = torch.ones(parts, dtype=torch.float32)
        layer.register_buffer("input_scale", buf, persistent=False)
        buf.weight_loader, buf.per_part, buf.output_dim, buf.full_precision = layer.weight_loader, True, None, True

    def _per_weight(self, layer: LinearBase, t: torch.Tensor) -> torch.Tensor:
        """A scale or zero point per weight, broadcastable to [N, K]: a per-part one spread over its
        rows, a group one over this rank's inputs' groups."""
        if self.strategy == "channel":
            return t.float()
        if self.strategy == "tensor":
            sizes = torch.tensor(layer.output_shard_sizes, device=t.device)
            return t.float().repeat_interleave(sizes)[:, None]
        k = layer.input_size
        first = layer.tp_rank * k if isinstance(layer, RowParallelLinear) else 0
        return t.float()[:, (first + torch.arange(k, device=t.device)) // self.group_size]

    def process_after_loading(self, layer: LinearBase) -> None:
        q = unpack_int8(layer.weight_packed.data) if self.packed else layer.weight.data
        values = q.float()
        if not self.symmetric:
            values -= self._per_weight(layer, layer.weight_zero_point.data)
        weight = (values * self._per_weight(layer, layer.weight_scale.data)).to(layer.params_dtype)
        for name in ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "input_scale"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def stack_linear(self, layer: LinearBase, gated: bool) -> StackLinear | None:
        """Widened, the layer is a plain one to the CPU's one-call decoder stack."""
        return None if gated else panels_linear(layer.weight, layer.output_size, layer.input_size, layer.bias)
