"""NVFP4 weights from compressed-tensors checkpoints (`nvfp4-pack-quantized`: llm-compressor's
NVFP4A16 and NVFP4 presets, RedHatAI's `*-NVFP4` models), dequantized once after loading into an
ordinary weight of the compute dtype on every device: the checkpoint's values, not FP4's memory
saving (no kernel here multiplies FP4; Hopper has no FP4 tensor cores). An NVFP4 (W4A4)
checkpoint's activation quantization is not applied: the layer computes in the model's dtype.

What the library stores, per linear with K inputs and N outputs:
- `weight_packed` uint8 [N, K / 2]: two E2M1 values a byte, the lower nibble first; a nibble is a
  sign bit and an index into E2M1's magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6);
- `weight_scale` E4M3 [N, K / 16]: a scale per 16 inputs;
- `weight_global_scale` fp32 [1], one per fused q / k / v and gate / up part;
- `input_global_scale` fp32 [1] with static NVFP4 activations (read, not used).
w[n, k] = e2m1[n, k] * weight_scale[n, k // 16] / weight_global_scale."""
from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels.cpu.decoder_stack import StackLinear, panels_linear
from shardserve.layers.linear import LinearBase, LinearMethod, linear
from shardserve.quantization.fp8 import register_optional_input_scale

GROUP = 16   # inputs per E4M3 scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> fp32 [N, K]: each byte's lower nibble, then its upper one."""
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    magnitude = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)[nibbles & 0x07]
    return torch.where(nibbles & 0x08 != 0, -magnitude, magnitude)


class Nvfp4LinearMethod(LinearMethod):
    def create_weights(self, layer: LinearBase) -> None:
        n, k, parts = layer.output_size, layer.input_size, len(layer.output_shard_sizes)
        if k % GROUP:
            raise ValueError(f"NVFP4 {type(layer).__name__}: {k} inputs per rank are not a multiple of {GROUP} (an "
                             "FP4 scale's inputs); use a smaller tensor_parallel_size")
        # (a row-parallel rank's share of the inputs is taken in each tensor's own units: bytes, scales)
        layer.register_quant_param("weight_packed", torch.empty(n, k // 2, dtype=torch.uint8), output_dim=0,
                                   input_dim=1)
        layer.register_quant_param("weight_scale", torch.empty(n, k // GROUP, dtype=torch.float8_e4m3fn),
                                   output_dim=0, input_dim=1, full_precision=True)
        layer.register_quant_param("weight_global_scale", torch.ones(parts, dtype=torch.float32), output_dim=None,
                                   per_part=True, full_precision=True)
        register_optional_input_scale(layer, "input_global_scale")

    def process_after_loading(self, layer: LinearBase) -> None:
        sizes = torch.tensor(layer.output_shard_sizes, device=layer.weight_packed.device)
        per_row = layer.weight_global_scale.data.float().repeat_interleave(sizes)[:, None]
        scale = layer.weight_scale.data.float().repeat_interleave(GROUP, dim=1) / per_row
        weight = (unpack_e2m1(layer.weight_packed.data) * scale).to(layer.params_dtype)
        for name in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
            delattr(layer, name)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def stack_linear(self, layer: LinearBase, gated: bool) -> StackLinear | None:
        """Dequantized, the layer is a plain one to the CPU's one-call decoder stack."""
        return None if gated else panels_linear(layer.weight, layer.output_size, layer.input_size, layer.bias)
