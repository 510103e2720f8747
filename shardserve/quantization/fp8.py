"""FP8 (W8A8, E4M3): `--quantization fp8` on a bf16/fp16/fp32 checkpoint, or an FP8 checkpoint
(`quantization_config.quant_method: fp8`, as llm-compressor and vLLM write them).

- Weights: E4M3 with a scale per output channel. A bf16 checkpoint is quantized after loading
  (absmax per row / 448). An FP8 checkpoint carries a scale per tensor (`weight_scale`), so fused
  q/k/v and gate/up layers keep one scale per part and spread it over that part's rows; one per
  output channel ([N, 1], compressed-tensors' channel strategy, quantization/compressed_tensors.py)
  is taken as it is.
- Activations: scaled per token at run time (dynamic). A checkpoint's static `input_scale` is read
  if present (`activation_scheme: static`) and not used: a per-token scale is never less accurate
  than one per tensor.
- CUDA: 1-16 rows (decode) go to a weight-streaming Triton GEMV that reads the E4M3 weight once
  and widens it in registers against the bf16/fp16 activations as they are (kernels/quant/
  triton_fp8_gemv.py; W8A16 there: no per-token rounding, no quantization kernel), with the gated
  gate_up form; more rows go to `torch._scaled_mm` on FP8 inputs with the row-wise scales
  (Hopper's FP8 tensor cores), bf16 out (17-256 rows: a Triton matmul where it measured faster,
  kernels/matmul/triton_skinny.py), after one Triton pass that quantizes the activations
  (kernels/quant/triton_fp8_quant.py). Where the kernel before the matmul is the RMSNorm (qkv,
  gate_up) or SiLU-and-mul (down), that kernel quantizes its own output instead and hands over
  `Fp8Rows` (`takes_fp8_rows`): one launch and one pass over the activations fewer per matmul
  (`SHARDSERVE_FP8_FUSED_QUANT=0`: the separate pass, for A/B runs). Elsewhere (the CPU): the FP8
  values are widened once, after loading, into an ordinary weight of the compute dtype, so every
  CPU kernel and test runs unchanged on the FP8-rounded values (the accuracy of FP8; not its memory saving).
- Layers the checkpoint leaves in 16 bits (`modules_to_not_convert`, transformers' key, or
  `ignored_layers`, AutoFP8's and vLLM's) load as plain layers (`Fp8Config.ignores`,
  models/loader.place_schemes).
- Block-wise scales (`weight_block_size`, e.g. [128, 128]: Qwen3-*-FP8, DeepSeek-V3; the weight's
  `weight_scale_inv` holds one multiplier per block): the linears keep E4M3 with their block scales
  (quantization/fp8_block.py), their MoE experts too (quantization/fp8_block_moe.py). Rounding
  block-scaled weights again to one scale per output channel, which the kernels above would run,
  was measured too coarse: the real SmolLM2 with 128 x 128 blocks went from +1.9%
  perplexity over bf16 (its block values) to +5.6%.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from shardserve.kernels.cpu.decoder_stack import StackLinear, panels_linear
from shardserve.kernels.matmul import triton_skinny
from shardserve.kernels.quant import triton_fp8_gemv, triton_fp8_quant
from shardserve.layers.linear import LinearBase, LinearMethod, linear
from shardserve.quantization.fp8_block import Fp8BlockLinearMethod
from shardserve.quantization.stored import left_out, left_out_patterns

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)   # 448
FUSED_QUANT = os.environ.get("SHARDSERVE_FP8_FUSED_QUANT", "1") != "0"   # the module docstring


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (E4M3 [N, K], fp32 scales [N]) with weight ~= q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (E4M3 [M, K], fp32 scales [M, 1]), one scale per token."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Config:
    name = "fp8"

    def __init__(self, from_checkpoint: bool, block: tuple[int, int] | None = None, skip: tuple[str, ...] = ()) -> None:
        self.from_checkpoint = from_checkpoint   # weights stored as FP8 (else quantized after loading)
        self.block = block                       # a block-scaled checkpoint's [rows, inputs] block
        self.skip = skip                         # layers the checkpoint leaves in 16 bits (`ignores`)
        # FP8 matmuls on CUDA (config.check_device); block-scaled weights are widened at load where FP8
        # is missing (fp8_block.py)
        self.fp8_matmuls = block is None

    @classmethod
    def from_quantization_config(cls, cfg: dict[str, Any]) -> "Fp8Config":
        fmt = cfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 format {fmt!r} is not supported; only e4m3 checkpoints are")
        # transformers' `modules_to_not_convert` (Qwen3-*-FP8), AutoFP8's / vLLM's `ignored_layers`
        skip = left_out_patterns(cfg, "modules_to_not_convert", "ignored_layers")
        block = cfg.get("weight_block_size")
        if block:
            if not (isinstance(block, (list, tuple)) and len(block) == 2
                    and all(isinstance(b, int) and b > 0 for b in block)):
                raise ValueError(f"FP8 quantization_config.weight_block_size={block!r}: expected [rows, columns]")
            return cls(from_checkpoint=False, block=(block[0], block[1]), skip=skip)
        return cls(from_checkpoint=True, skip=skip)

    def linear_method(self, layer: LinearBase) -> LinearMethod:
        return Fp8BlockLinearMethod(self.block) if self.block else Fp8LinearMethod(self.from_checkpoint)

    def ignores(self, name: str) -> bool:
        """Whether the checkpoint leaves layer `name` in 16 bits (models/loader.place_schemes asks;
        stored.left_out's rule)."""
        return left_out(name, self.skip)


class FbgemmFp8Config(Fp8Config):
    """Meta's FP8 checkpoints (`quant_method: fbgemm_fp8`: Llama-3.1-405B-Instruct-FP8): E4M3 weights
    with a scale per output channel (`weight_scale` [N, 1], fp32), activations quantized per token at
    run time. `modules_to_not_convert` names the layers left in 16 bits (transformers' rule: a prefix
    ending at a module boundary, a regex with that boundary, or a suffix; models/loader.place_schemes
    makes them plain). The bound on the activations' scale (`activation_scale_ub`) is not applied: the
    per-token scales are those of every FP8 layer here (and the CPU and the decode GEMV do not round
    activations at all). MoE experts in this format are refused."""
    name = "fbgemm_fp8"

    @classmethod
    def from_quantization_config(cls, cfg: dict[str, Any]) -> "FbgemmFp8Config":
        return cls(from_checkpoint=True, skip=left_out_patterns(cfg, "modules_to_not_convert"))

    def linear_method(self, layer: LinearBase) -> LinearMethod:
        return Fp8LinearMethod(from_checkpoint=True, per_channel=True)


def register_optional_input_scale(layer: LinearBase, name: str = "input_scale") -> None:
    """A static `input_scale` per fused part: optional (a dynamic-scheme checkpoint has none), read and
    dropped (activations are scaled per token). Buffers with a weight_loader are what models/loader.py
    fills when present."""
    buf = torch.ones(len(layer.output_shard_sizes), dtype=torch.float32)
    layer.register_buffer(name, buf, persistent=False)
    buf.weight_loader, buf.per_part, buf.output_dim, buf.full_precision = layer.weight_loader, True, None, True


def _scaled_matmul(layer: LinearBase, xq: torch.Tensor, x_scale: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """FP8 rows [M, K] with their scales [M, 1] times the layer's FP8 weight: the Triton tiles where
    this GPU's table says they beat `torch._scaled_mm` at M rows (decode-sized batches), else it."""
    tiles = triton_skinny.fp8_tiles(*layer.weight.shape, xq.shape[0], xq.device)
    if tiles is not None:
        return triton_skinny.matmul(xq, layer.weight, bias, x_scale, layer.weight_scale, dtype, tiles)
    return torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale.view(1, -1),
                            bias=bias, out_dtype=dtype)


class Fp8LinearMethod(LinearMethod):
    def __init__(self, from_checkpoint: bool, per_channel: bool = False) -> None:
        self.from_checkpoint = from_checkpoint
        self.per_channel = per_channel   # the checkpoint's weight_scale: [N, 1] (compressed-tensors' channel strategy)

    def create_weights(self, layer: LinearBase) -> None:
        if not self.from_checkpoint:   # the checkpoint's own dtype first; quantized after loading
            layer.register_weight(torch.empty(layer.output_size, layer.input_size))
            return
        layer.register_weight(torch.empty(layer.output_size, layer.input_size, dtype=FP8))
        parts = len(layer.output_shard_sizes)
        if self.per_channel:
            layer.register_quant_param("weight_scale", torch.ones(layer.output_size, 1, dtype=torch.float32),
                                       output_dim=0, full_precision=True)
        else:   # one per fused part (q, k, v / gate, up)
            layer.register_quant_param("weight_scale", torch.ones(parts, dtype=torch.float32), output_dim=None,
                                       per_part=True, full_precision=True)
        register_optional_input_scale(layer)

    def process_after_loading(self, layer: LinearBase) -> None:
        if self.from_checkpoint:   # per-part scales spread over each part's rows
            if self.per_channel:
                scale = layer.weight_scale.data.view(-1)
            else:
                sizes = torch.tensor(layer.output_shard_sizes, device=layer.weight.device)
                scale = layer.weight_scale.data.repeat_interleave(sizes)
            weight = layer.weight.data
            del layer.weight_scale, layer.input_scale   # input_scale: read, unused (the module docstring)
        else:
            weight, scale = quantize_rows(layer.weight.data)
        if weight.is_cuda:
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale.float(), requires_grad=False)
        else:   # widened once into the dtype the layer was built in (the compute dtype)
            layer.weight = nn.Parameter((weight.float() * scale[:, None]).to(layer.params_dtype), requires_grad=False)

    def stack_linear(self, layer: LinearBase, gated: bool) -> StackLinear | None:
        """Widened on the CPU, the layer is a plain one to the one-call decoder stack."""
        if gated or layer.weight.dtype == FP8:
            return None
        return panels_linear(layer.weight, layer.output_size, layer.input_size, layer.bias)

    def takes_fp8_rows(self, layer: LinearBase, x: torch.Tensor) -> bool:
        return (FUSED_QUANT and layer.weight.dtype == FP8 and triton_fp8_quant.handles(x)
                and not triton_fp8_gemv.handles(x, layer.weight))

    def apply(self, layer: LinearBase, x: torch.Tensor | triton_fp8_quant.Fp8Rows,
              bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, triton_fp8_quant.Fp8Rows):   # quantized by the kernel before (takes_fp8_rows)
            return _scaled_matmul(layer, x.q, x.scale, bias, x.dtype)
        if layer.weight.dtype != FP8:
            return linear(x, layer.weight, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if triton_fp8_gemv.handles(x2, layer.weight):   # a decode batch: the weight-streaming GEMV
            out = triton_fp8_gemv.gemv(x2, layer.weight, layer.weight_scale, bias)
            return out.view(*shape[:-1], out.shape[-1])
        # one Triton pass instead of six torch kernels (20-600 us on the 8B shapes, more than the matmul saves)
        xq, x_scale = (triton_fp8_quant.quantize_tokens if triton_fp8_quant.handles(x2) else quantize_tokens)(x2)
        out = _scaled_matmul(layer, xq, x_scale, bias, x.dtype)
        return out.view(*shape[:-1], out.shape[-1])

    def apply_gated(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        if (isinstance(x, triton_fp8_quant.Fp8Rows) or layer.weight.dtype != FP8 or x.dim() != 2
                or not triton_fp8_gemv.handles(x, layer.weight, gated=True)):
            return None
        return triton_fp8_gemv.gemv(x, layer.weight, layer.weight_scale, gated=True)
