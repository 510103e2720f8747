"""FP4 weights from compressed-tensors checkpoints, dequantized once after loading into an ordinary
weight of the compute dtype: the checkpoint's values at bf16's speed, not FP4's memory saving. With
SHARDSERVE_FP4_KERNELS=1 they stay 4-bit on CUDA (about 4.5 bits a weight with their scales),
repacked once into kernels/quant/triton_fp4.py's layout: decode batches (1-4 rows) run the
tensor-core GEMV of kernels/quant/triton_fp4_gemv.py (the gate_up pair with its SiLU-and-mul in one
kernel), 5-64 rows triton_fp4.matmul (its 17-64-row form scales the weights before their products),
more rows cuBLAS on the weight dequantized for the call.
Hopper has no FP4 tensor cores: the kernels multiply in the activations' dtype (W4A16), so a
checkpoint's FP4 activation quantization (W4A4) is not applied. docs/models.md has the figures.

- NVFP4 (`nvfp4-pack-quantized`: llm-compressor's NVFP4A16 and NVFP4 presets, RedHatAI's `*-NVFP4`):
  an E4M3 `weight_scale` per 16 inputs [N, K / 16] and an fp32 `weight_global_scale` [1] per fused
  q / k / v and gate / up part; w = e2m1 * weight_scale / weight_global_scale.
- MXFP4 (`mxfp4-pack-quantized`: the MXFP4A16 and MXFP4 presets): a uint8 E8M0 `weight_scale` per 32
  inputs [N, K / 32], a power of two 2^(e - 127); w = e2m1 * 2^(weight_scale - 127).
Both: `weight_packed` uint8 [N, K / 2], two E2M1 values a byte, the lower nibble first, a nibble
being a sign bit and an index into E2M1's magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6);
`input_global_scale` [1] with static FP4 activations (read, not used).
NVIDIA ModelOpt's NVFP4 (quantization/modelopt.py) is the same layout under other names: `weight`,
`weight_scale`, a multiplier `weight_scale_2` (w = e2m1 * weight_scale * weight_scale_2), `input_scale`."""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from shardserve.kernels.cpu.decoder_stack import StackLinear, panels_linear
from shardserve.kernels.quant import triton_fp4, triton_fp4_gemv
from shardserve.kernels.quant.triton_fp4 import GROUP  # inputs a scale
from shardserve.layers.linear import LinearBase, LinearMethod, linear
from shardserve.quantization.fp8 import register_optional_input_scale
from shardserve.quantization.stored import fp4_kept_on_gpus

logger = logging.getLogger("shardserve")

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
DOT_MAX_ROWS = 64   # more rows: the weight dequantized for the call, then cuBLAS (faster past 64: BENCHMARKS.md)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> fp32 [N, K]: each byte's lower nibble, then its upper one."""
    nibbles = triton_fp4.codes(packed)
    magnitude = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)[nibbles & 0x07]
    return torch.where(nibbles & 0x08 != 0, -magnitude, magnitude)


def dequantize(packed: torch.Tensor, scale_bytes: torch.Tensor, kind: str, global_scale: torch.Tensor | None = None,
               global_multiplies: bool = False) -> torch.Tensor:
    """fp32 [N, K] from packed [N, K / 2] and the stored scales [N, K / G] (NVFP4: E4M3 under a global
    scale per row [N, 1], a divisor, or with global_multiplies ModelOpt's multiplier; MXFP4: E8M0)."""
    if kind == "nvfp4":
        scale = scale_bytes.float() * global_scale if global_multiplies else scale_bytes.float() / global_scale
    else:
        scale = torch.exp2(scale_bytes.float() - E8M0_BIAS)
    return unpack_e2m1(packed) * scale.repeat_interleave(GROUP[kind], dim=1)


@functools.cache
def _say(kept: bool) -> None:   # once per process, at the first FP4 layer on a GPU
    if kept:
        logger.info("FP4 weights kept 4-bit on CUDA (SHARDSERVE_FP4_KERNELS=1, kernels/quant/triton_fp4_gemv.py)")
    else:
        logger.info("FP4 weights dequantized to the compute dtype at load (SHARDSERVE_FP4_KERNELS=1 keeps them "
                    "4-bit on CUDA: ~2.7x less weight memory; docs/models.md)")


class Fp4LinearMethod(LinearMethod):
    def __init__(self, kind: str, modelopt: bool = False) -> None:
        self.kind = kind   # "nvfp4" | "mxfp4"
        self.group = GROUP[kind]
        # NVIDIA ModelOpt's NVFP4 names (quantization/modelopt.py): `weight` for the packed values, a
        # multiplier `weight_scale_2` for the global divisor, `input_scale`
        self.names = (("weight", "weight_scale_2", "input_scale") if modelopt
                      else ("weight_packed", "weight_global_scale", "input_global_scale"))
        self.global_multiplies = modelopt

    def create_weights(self, layer: LinearBase) -> None:
        n, k, parts = layer.output_size, layer.input_size, len(layer.output_shard_sizes)
        if k % self.group:
            raise ValueError(f"{self.kind.upper()} {type(layer).__name__}: {k} inputs per rank are not a multiple of "
                             f"{self.group} (an FP4 scale's inputs); use a smaller tensor_parallel_size")
        # (a row-parallel rank's share of the inputs is taken in each tensor's own units: bytes, scales)
        packed_name, global_name, input_name = self.names
        layer.register_quant_param(packed_name, torch.empty(n, k // 2, dtype=torch.uint8), output_dim=0, input_dim=1)
        scale_dtype = torch.float8_e4m3fn if self.kind == "nvfp4" else torch.uint8
        layer.register_quant_param("weight_scale", torch.empty(n, k // self.group, dtype=scale_dtype),
                                   output_dim=0, input_dim=1, full_precision=True)
        if self.kind == "nvfp4":
            layer.register_quant_param(global_name, torch.ones(parts, dtype=torch.float32),
                                       output_dim=None, per_part=True, full_precision=True)
        register_optional_input_scale(layer, input_name)

    def process_after_loading(self, layer: LinearBase) -> None:
        packed_name, global_name, input_name = self.names
        stored, packed = layer.weight_scale.data, getattr(layer, packed_name).data
        if self.kind == "nvfp4":   # each row's part's global scale: a multiplier (ModelOpt) or a divisor
            sizes = torch.tensor(layer.output_shard_sizes, device=stored.device)
            per_row = getattr(layer, global_name).data.float().repeat_interleave(sizes)
        for name in (packed_name, "weight_scale", global_name, input_name):
            if hasattr(layer, name):
                delattr(layer, name)
        # kept 4-bit in the kernels' layout, the scales as their bytes, for 16-bit activations only
        # (fp32 ones would reach the tensor cores as tf32)
        kept = packed.is_cuda and fp4_kept_on_gpus() and layer.params_dtype in (torch.bfloat16, torch.float16)
        if packed.is_cuda:
            _say(kept)
        if kept:
            if self.kind == "nvfp4":
                row_scale = per_row if self.global_multiplies else 1.0 / per_row
            else:
                row_scale = torch.ones(stored.shape[0], dtype=torch.float32, device=stored.device)
            layer.fp4_words = nn.Parameter(triton_fp4.repack(packed), requires_grad=False)
            layer.fp4_scales = nn.Parameter(stored.view(torch.uint8), requires_grad=False)
            layer.fp4_row_scale = nn.Parameter(row_scale, requires_grad=False)
            return
        weight = dequantize(packed, stored, self.kind, per_row[:, None] if self.kind == "nvfp4" else None,
                            self.global_multiplies)
        layer.weight = nn.Parameter(weight.to(layer.params_dtype), requires_grad=False)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not hasattr(layer, "fp4_words"):
            return linear(x, layer.weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        args = (layer.fp4_words, layer.fp4_scales, layer.fp4_row_scale)
        rows, k = flat.shape
        if 0 < rows <= triton_fp4_gemv.MAX_ROWS:
            out = triton_fp4_gemv.gemv(flat, *args, self.kind, k, bias=bias)
        elif rows <= DOT_MAX_ROWS:
            out = triton_fp4.matmul(flat, *args, bias, self.kind, k)
        else:
            out = linear(flat, triton_fp4.dequantize(*args, self.kind, k, flat.dtype), bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    def apply_gated(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        if not hasattr(layer, "fp4_words") or x.dim() != 2 or not 0 < x.shape[0] <= triton_fp4_gemv.MAX_ROWS:
            return None
        return triton_fp4_gemv.gemv(x, layer.fp4_words, layer.fp4_scales, layer.fp4_row_scale, self.kind, x.shape[1],
                                    gated=True)

    def stack_linear(self, layer: LinearBase, gated: bool) -> StackLinear | None:
        """Dequantized, the layer is a plain one to the CPU's one-call decoder stack."""
        return None if gated else panels_linear(layer.weight, layer.output_size, layer.input_size, layer.bias)
