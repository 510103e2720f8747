"""INT8 weights from compressed-tensors checkpoints (llm-compressor's W8A8 and W8A16: RedHatAI's
`*-quantized.w8a8` and `*-quantized.w8a16` models).

- CUDA, symmetric weights with per-channel or per-tensor scales (the W8A8 presets): kept INT8 with
  an fp32 scale per output row. 1-16 rows (decode) run the FP8 decode GEMV's loops, which widen INT8
  to fp16 in registers exactly as they do E4M3 (kernels/quant/triton_fp8_gemv.py; W8A16); more rows
  are rounded to INT8 per token and multiplied on the INT8 tensor cores (kernels/quant/triton_int8.py:
  one Triton pass rounds, `torch._int_mm` sums in int32, one Triton pass applies both scales; W8A8, as
  the checkpoint's dynamic per-token scheme says; a static `input_scale` is read and not used: a
  per-token scale is never less accurate).
- Elsewhere (the CPU; group scales or zero points on a GPU): widened once after loading into an
  ordinary weight of the compute dtype, so the checkpoint serves with its INT8 values' accuracy, not
  INT8's memory saving, on the unquantized kernels (the CPU's one-call decoder stack too).

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
from shardserve.kernels.quant import triton_fp8_gemv, triton_int8
from shardserve.layers.linear import LinearBase, LinearMethod, RowParallelLinear, linear
from shardserve.layers.moe import FusedMoE
from shardserve.quantization.fp8 import register_optional_input_scale
from shardserve.quantization.fp8_moe import Fp8MoEMethod

PACK = 4            # 8-bit values per int32 word (pack-quantized)
PACKED_OFFSET = 128  # pack-quantized stores value + 128 (unsigned bytes)


def unpack_int8(words: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 4] -> int16 [N, K]: each word's four bytes, low byte first, less the offset."""
    data = words.contiguous()
    n = data.shape[0]
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=data.device)
    values = (data.unsqueeze(-1) >> shifts) & 0xFF
    return values.reshape(n, -1).to(torch.int16) - PACKED_OFFSET


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 in torch ops (the reference of kernels/quant/triton_int8.py, and the shapes it does not
    take): x [M, K] rounded to INT8 per token, times the INT8 weight [N, K], the token and row scales
    (and the bias) applied in fp32 before the one rounding."""
    x_scale = (x.float().abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
    xq = (x.float() / x_scale).round().clamp(-127, 127)
    sums = xq @ weight.float().t()   # (exact in fp32 up to K ~ 1000, rounded beyond)
    out = sums * x_scale * scale
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


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
        register_optional_input_scale(layer)

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

    def kept(self, device: torch.device) -> bool:
        """Whether the weights stay INT8 on `device` (the module docstring; quantization/stored.py's
        weight_dtype says the same to the planner)."""
        return device.type == "cuda" and self.symmetric and self.strategy != "group"

    def process_after_loading(self, layer: LinearBase) -> None:
        q = unpack_int8(layer.weight_packed.data) if self.packed else layer.weight.data
        if self.kept(q.device):
            scale = self._per_weight(layer, layer.weight_scale.data).reshape(-1).contiguous()
            self._drop_checkpoint_tensors(layer)
            layer.weight = nn.Parameter(q.to(torch.int8).contiguous(), requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            return
        values = q.float()
        if not self.symmetric:
            values -= self._per_weight(layer, layer.weight_zero_point.data)
        weight = (values * self._per_weight(layer, layer.weight_scale.data)).to(layer.params_dtype)
        self._drop_checkpoint_tensors(layer)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    @staticmethod
    def _drop_checkpoint_tensors(layer: LinearBase) -> None:
        for name in ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "input_scale"):
            if hasattr(layer, name):
                delattr(layer, name)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.weight.dtype != torch.int8:   # widened
            return linear(x, layer.weight, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if triton_fp8_gemv.handles(x2, layer.weight):   # a decode batch
            out = triton_fp8_gemv.gemv(x2, layer.weight, layer.weight_scale, bias)
        elif triton_int8.handles(x2, layer.weight):
            out = triton_int8.matmul(x2, layer.weight, layer.weight_scale, bias)
        else:
            out = int8_matmul(x2, layer.weight, layer.weight_scale, bias)
        return out.view(*shape[:-1], out.shape[-1])

    def apply_gated(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        if layer.weight.dtype != torch.int8 or x.dim() != 2 or not triton_fp8_gemv.handles(x, layer.weight, gated=True):
            return None
        return triton_fp8_gemv.gemv(x, layer.weight, layer.weight_scale, gated=True)

    def stack_linear(self, layer: LinearBase, gated: bool) -> StackLinear | None:
        """Widened, the layer is a plain one to the CPU's one-call decoder stack."""
        return None if gated else panels_linear(layer.weight, layer.output_size, layer.input_size, layer.bias)


class Int8MoEMethod(Fp8MoEMethod):
    """MoE experts in INT8, symmetric with per-channel or per-tensor scales (the W8A8 presets; other
    INT8 expert layouts are refused, quantization/config.moe_method), stored per expert as the linears
    are (`experts.N.gate_proj.weight` int8, `weight_scale`, an optional `input_scale`): read as the FP8
    experts are (quantization/fp8_moe.py: a tensor's scale spread over its rows, `input_scale` dropped).
    - CPU: kept INT8 (half of bf16's memory), each picked expert widened for its own matmul with its
      row scales on the output (kernels/moe/torch_moe.py), exact like FP8's.
    - CUDA: widened once after loading into the compute dtype, one expert at a time, for the fused
      Triton MoE kernel, which takes no INT8 experts yet (and the torch path's host syncs would break
      CUDA graphs): the checkpoint's values, not its memory saving."""
    checkpoint_dtype = torch.int8

    def __init__(self) -> None:
        super().__init__(from_checkpoint=True)

    def create_weights(self, layer: FusedMoE) -> None:
        self.compute_dtype = torch.get_default_dtype()
        super().create_weights(layer)

    def process_after_loading(self, layer: FusedMoE) -> None:
        super().process_after_loading(layer)
        if not layer.w13_weight.is_cuda:
            return
        for name in ("w13_weight", "w2_weight"):
            q, scale = getattr(layer, name).data, getattr(layer, f"{name}_scale").data
            wide = torch.empty(q.shape, dtype=self.compute_dtype, device=q.device)
            for expert in range(q.shape[0]):   # the fp32 temporaries stay one expert's size
                wide[expert] = (q[expert].float() * scale[expert][:, None]).to(self.compute_dtype)
            setattr(layer, name, nn.Parameter(wide, requires_grad=False))
            setattr(layer, f"{name}_scale", None)   # (apply then runs them as plain experts)
