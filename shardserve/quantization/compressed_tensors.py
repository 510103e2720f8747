"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, what llm-compressor writes:
RedHatAI's `*-FP8-dynamic`, `*-FP8`, `*-quantized.w4a16`, `*-quantized.w8a8` models and most FP8 / INT4 checkpoints on
the Hub). The scheme is read by quantization/ct_scheme.py; the layers then run on the methods of
the other formats, each reading the tensors as the library names and packs them:

- FP8 (`float-quantized`): `weight` E4M3 and `weight_scale` per tensor ([1]) or per output channel
  ([N, 1]): quantization/fp8.py's method; per block (`block_structure`, [N / bn, K / bk]): the
  block-scaled method (quantization/fp8_block.py), its scales named `weight_scale` here. A static
  `input_scale` is read and dropped (activations are scaled per token).
- INT4 (`pack-quantized`): `weight_packed` int32 [N, K / 8], eight 4-bit values per word, low bits
  first, along the inputs, each stored as value + 8; `weight_scale` [N, groups] (channel strategy:
  one group); `weight_zero_point` int32 [N / 8, groups] packed the same way along the outputs when
  the scheme is asymmetric (else the zero is 8); `weight_shape` (read, not needed); with `actorder:
  group`, `weight_g_idx` int32 [K], each input's group (GPTQ's g_idx: the INT4 method's desc_act
  path sorts the inputs by group for the kernels). So w[n, k] = (nibble - zero nibble) * scale of
  k's group: the INT4 method of quantization/int4.py takes it from there (the CUDA W4A16 kernels,
  or dequantized on the CPU).
- INT8 (`int-quantized`: `weight` int8; `pack-quantized`: four values per int32 word): quantization/
  int8.py's method (its docstring has the tensors): kept INT8 on CUDA where symmetric per channel or
  tensor, else widened at load.
- The LM head is quantized like the linears when `ignore` does not name it (untied heads only,
  layers/vocab.py). MoE experts, stored per expert as the linears: FP8 with tensor or channel
  scales are the FP8 MoE method's (quantization/fp8_moe.py: the same `weight` / `weight_scale`
  names), block-scaled ones the block method's (quantization/fp8_block_moe.py, `weight_scale`
  for its `weight_scale_inv`), INT4 ones `CtInt4MoEMethod`'s below, INT8 ones (symmetric, channel or
  tensor scales) quantization/int8.Int8MoEMethod's (quantization/config.py picks).
- NVFP4 and MXFP4 (`nvfp4-pack-quantized`, `mxfp4-pack-quantized`): quantization/fp4.py's method
  (dequantized at load; its docstring has the tensors); MoE experts in FP4 are refused."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardserve.layers.linear import LinearBase, LinearMethod
from shardserve.layers.moe import FusedMoE
from shardserve.quantization.ct_scheme import CtLayout, CtScheme, parse
from shardserve.quantization.fp4 import Fp4LinearMethod
from shardserve.quantization.fp8 import Fp8LinearMethod
from shardserve.quantization.fp8_block import Fp8BlockLinearMethod
from shardserve.quantization.int4 import PACK, Int4Config, Int4LinearMethod, same_order_for_every_part, unpack_int4
from shardserve.quantization.int4_moe import Int4MoEMethod
from shardserve.quantization.int8 import Int8LinearMethod

SYMMETRIC_ZERO = 8   # a symmetric scheme's values are stored as value + 8: zero is 8 in the nibbles


def _read_as_nothing(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """`weight_shape`, the tensor's original shape: the other tensors' shapes say it already."""


class CompressedTensorsConfig:
    name = "compressed-tensors"

    def __init__(self, layout: CtLayout) -> None:
        self.layout = layout
        self.scheme = layout.default   # the scheme layers are built in (models/loader.place_schemes)
        self.lm_head = layout.scheme_for("lm_head") is not None
        # FP8 matmuls on CUDA (config.check_device); FP8 blocks are widened at load on GPUs without them
        self.fp8_matmuls = any(s.weights == "fp8" and not s.block for s in layout.schemes)

    @classmethod
    def from_quantization_config(cls, cfg: dict[str, Any]) -> "CompressedTensorsConfig":
        return cls(parse(cfg))

    def scheme_for(self, name: str) -> CtScheme | None:
        """The scheme the checkpoint stores layer `name` in (None: full precision; models/loader.py asks)."""
        return self.layout.scheme_for(name)

    def linear_method(self, layer: LinearBase, scheme: CtScheme | None = None) -> LinearMethod:
        s = scheme or self.scheme
        if s.weights == "fp8":
            if s.block:
                return Fp8BlockLinearMethod(s.block, scale_name="weight_scale")
            return Fp8LinearMethod(from_checkpoint=True, per_channel=s.strategy == "channel")
        if s.weights == "int8":
            return Int8LinearMethod(s.strategy, s.symmetric, s.packed, s.group_size)
        if s.weights in ("nvfp4", "mxfp4"):
            return Fp4LinearMethod(s.weights)
        return CtInt4LinearMethod(self.int4_config(s), s.symmetric)

    def int4_config(self, scheme: CtScheme | None = None) -> Int4Config:
        s = scheme or self.scheme
        config = Int4Config(s.group_size if s.strategy == "group" else None, desc_act=s.actorder_group)
        config.name = self.name
        return config


class CtInt4LinearMethod(Int4LinearMethod):
    """pack-quantized INT4: the checkpoint's tensors (the module docstring) into the INT4 method's."""

    def __init__(self, config: Int4Config, symmetric: bool) -> None:
        super().__init__(config)
        self.gptq = False
        self.packed_by_input = True
        self.symmetric = symmetric
        self.zeros_by_output = not symmetric

    def create_weights(self, layer: LinearBase) -> None:
        k, n = layer.input_size, layer.output_size
        groups, group_dim = self._layout(layer)
        layer.register_quant_param("weight_packed", torch.empty(n, k // PACK, dtype=torch.int32), output_dim=0,
                                   input_dim=1, packed_dim=1, pack_factor=PACK)
        layer.register_quant_param("weight_scale", torch.empty(n, groups, dtype=torch.float32), output_dim=0,
                                   input_dim=None if group_dim is None else 1, full_precision=True)
        if not self.symmetric:
            layer.register_quant_param("weight_zero_point", torch.empty(n // PACK, groups, dtype=torch.int32),
                                       output_dim=0, input_dim=None if group_dim is None else 1, packed_dim=0,
                                       pack_factor=PACK)
        shape = layer.register_quant_param("weight_shape", torch.zeros(2, dtype=torch.int64), output_dim=None)
        shape.weight_loader = _read_as_nothing
        if self.config.desc_act:
            g_idx = layer.register_quant_param("weight_g_idx", torch.empty(k, dtype=torch.int32), output_dim=None,
                                               input_dim=0)
            if len(layer.output_shard_sizes) > 1:
                same_order_for_every_part(g_idx)

    def checkpoint_tensors(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                               torch.Tensor | None]:
        scales = layer.weight_scale.data.t().contiguous()
        if self.symmetric:
            zeros = torch.full_like(scales, SYMMETRIC_ZERO, dtype=torch.int32)
        else:
            zeros = unpack_int4(layer.weight_zero_point.data, 0).t().contiguous()
        g_idx = layer.weight_g_idx.data if self.config.desc_act else None
        out = layer.weight_packed.data, zeros, scales, g_idx
        for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        return out

    def _unpack(self, qweight: torch.Tensor) -> torch.Tensor:
        return unpack_int4(qweight, 1).t().contiguous()   # [N, K] words along K -> values [K, N]


SYMMETRIC_ZERO_WORD = int.from_bytes(bytes([0x88] * 4), "little", signed=True)   # eight zeros of 8 in one word


class CtInt4MoEMethod(Int4MoEMethod):
    """pack-quantized INT4 experts, stored per expert as the linears are: each tensor is GPTQ's
    (gptq_v2: zeros as they are) transposed, so it is transposed as it loads and the INT4 MoE
    method (quantization/int4_moe.py) slices and converts it as a GPTQ expert's."""

    def __init__(self, config: Int4Config, symmetric: bool) -> None:
        super().__init__(config)
        self.gptq = True
        self.symmetric = symmetric

    def create_weights(self, layer: FusedMoE) -> None:
        super().create_weights(layer)
        for part in self.parts:   # the GPTQ method's g_idx, named as these checkpoints name it (actorder group)
            _rename_buffer(layer, f"{part.name}_g_idx", f"{part.name}_weight_g_idx")

    def _register(self, layer: FusedMoE, part, field: str, data: torch.Tensor) -> None:
        if field == "qzeros" and self.symmetric:   # none stored: every zero is 8
            layer.register_buffer(f"{part.name}_qzeros", torch.full_like(data, SYMMETRIC_ZERO_WORD), persistent=False)
            return
        name = {"qweight": "weight_packed", "scales": "weight_scale", "qzeros": "weight_zero_point"}[field]
        param = layer.register_expert_param(f"{part.name}_{name}", data)
        load = self._loader(layer, part, field)
        param.weight_loader = lambda param, loaded, shard_id: load(param, loaded.t(), shard_id)
        param.full_precision = field == "scales"
        if field == "qweight":
            shape = torch.zeros(2, dtype=torch.int64)
            layer.register_buffer(f"{part.name}_weight_shape", shape, persistent=False)
            shape.weight_loader = _read_as_nothing

    def _convert(self, layer: FusedMoE, part) -> None:
        for field, name in (("qweight", "weight_packed"), ("scales", "weight_scale"), ("qzeros", "weight_zero_point")):
            stored = getattr(layer, f"{part.name}_{name}", None)
            if stored is not None:
                delattr(layer, f"{part.name}_{name}")
                layer.register_parameter(f"{part.name}_{field}", nn.Parameter(stored.data, requires_grad=False))
        delattr(layer, f"{part.name}_weight_shape")
        _rename_buffer(layer, f"{part.name}_weight_g_idx", f"{part.name}_g_idx")
        super()._convert(layer, part)


def _rename_buffer(layer: nn.Module, old: str, new: str) -> None:
    buffer = getattr(layer, old)
    delattr(layer, old)
    layer.register_buffer(new, buffer, persistent=False)
