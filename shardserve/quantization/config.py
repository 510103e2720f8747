"""Which weight format a model runs in: `--quantization` (vLLM's flag) or the checkpoint's
`quantization_config`, checked against each other and the device before anything loads."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from shardserve.layers.linear import LinearBase, LinearMethod
from shardserve.layers.moe import FusedMoE, MoEMethod
from shardserve.layers.vocab import ParallelLMHead
from shardserve.quantization.compressed_tensors import CompressedTensorsConfig, CtInt4MoEMethod
from shardserve.quantization.ct_scheme import sparsity_only
from shardserve.quantization.fp4_moe import Fp4MoEMethod
from shardserve.quantization.fp8 import FbgemmFp8Config, Fp8Config
from shardserve.quantization.fp8_block_moe import Fp8BlockMoEMethod
from shardserve.quantization.fp8_moe import Fp8MoEMethod
from shardserve.quantization.gguf import GgufConfig
from shardserve.quantization.gguf_moe import GgufMoEMethod
from shardserve.quantization.int4 import AwqConfig, GptqConfig
from shardserve.quantization.int4_moe import Int4MoEMethod
from shardserve.quantization.int8 import Int8MoEMethod
from shardserve.quantization.modelopt import ModelOptConfig

QUANTIZATION_METHODS = ("fp8",)   # quantize a full-precision checkpoint at load
_FROM_CHECKPOINT = {"fp8": Fp8Config, "gptq": GptqConfig, "awq": AwqConfig, "gguf": GgufConfig,
                    "compressed-tensors": CompressedTensorsConfig, "fbgemm_fp8": FbgemmFp8Config,
                    "modelopt": ModelOptConfig}
CHECKPOINT_FORMATS = tuple(_FROM_CHECKPOINT)   # --quantization may also name the checkpoint's own format, as in vLLM
# each has .name and .linear_method(layer)
QuantConfig = Fp8Config | GptqConfig | AwqConfig | GgufConfig | CompressedTensorsConfig | ModelOptConfig


def resolve_quantization(requested: str | None, hf_config: dict[str, Any]) -> QuantConfig | None:
    """The format's config, or None for full precision. A checkpoint that is already quantized
    decides; `requested` must then name the same format (or be None)."""
    stored = hf_config.get("quantization_config")
    if stored:
        method = stored.get("quant_method")
        if method not in _FROM_CHECKPOINT:
            raise ValueError(f"the checkpoint is quantized with {method!r}, which is not supported; supported: "
                             f"{', '.join(sorted(_FROM_CHECKPOINT))}")
        if requested not in (None, method):
            raise ValueError(f"--quantization {requested} does not match the checkpoint's {method!r} weights; "
                             "drop the flag or give a full-precision checkpoint")
        if method == "compressed-tensors" and sparsity_only(stored):   # pruned, stored dense, not quantized
            return None
        return _FROM_CHECKPOINT[method].from_quantization_config(stored)
    if requested is None:
        return None
    if requested == "fp8":
        return Fp8Config(from_checkpoint=False)
    if requested == "gguf" and "gguf_architecture" in hf_config:   # a GGUF file whose every tensor is dequantized
        return None
    if requested in _FROM_CHECKPOINT:
        raise ValueError(f"--quantization {requested} names the format of an already quantized checkpoint; this one "
                         f"is full precision (only {', '.join(QUANTIZATION_METHODS)} quantizes at load)")
    raise ValueError(f"--quantization {requested!r} is not supported; choose one of {', '.join(QUANTIZATION_METHODS)}")


def check_device(config: QuantConfig | None, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse what cannot run, before any process starts."""
    if config is None or device.type != "cuda":
        return
    if getattr(config, "fp8_matmuls", False):   # FP8 weights in any of the checkpoint's schemes, not block-scaled
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"FP8 matmuls need a GPU of compute capability 8.9 or newer (Ada, Hopper); this one "
                             f"is {major}.{minor}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"FP8 on CUDA computes in bfloat16 or float16, not {dtype}: pass --dtype bfloat16")


def moe_method(config: QuantConfig, layer: FusedMoE, scheme: Any = None) -> MoEMethod | None:
    """The experts' method for a format: FP8, GPTQ / AWQ (INT4), GGUF and compressed-tensors have one
    (GGUF experts of a type not kept arrive dequantized, models/gguf_loader.py, and run unquantized).
    A format without one would be refused here, while the model is built, before any weight loads.
    scheme: the experts' own, where the checkpoint stores them in another scheme than the model's
    linears (compressed-tensors groups, GPTQ's `dynamic`, ModelOpt's MIXED_PRECISION:
    models/loader.place_schemes)."""
    if config.name == "fp8" or (config.name == "modelopt" and (scheme or config.algo) == "FP8"):   # (as FP8's)
        return Fp8BlockMoEMethod(config.block) if config.block else Fp8MoEMethod(config.from_checkpoint)
    if config.name in ("gptq", "awq"):
        int4 = config.for_scheme(scheme) if config.name == "gptq" else config
        if int4.bits != 4:
            raise ValueError(f"{int4.bits}-bit GPTQ weights for the experts of a mixture-of-experts layer "
                             f"({layer.prefix}) are not supported; 4-bit ones are")
        return Int4MoEMethod(int4)
    if config.name == "gguf":
        return GgufMoEMethod()
    ct = (scheme or config.scheme) if config.name == "compressed-tensors" else None
    if ct is not None and ct.weights == "fp8":   # per-expert weight + weight_scale
        return Fp8BlockMoEMethod(ct.block, scale_name="weight_scale") if ct.block else Fp8MoEMethod(True)
    if ct is not None and ct.weights in ("nvfp4", "mxfp4"):
        return Fp4MoEMethod(ct.weights)
    if config.name == "modelopt" and (scheme or config.algo) == "NVFP4":
        return Fp4MoEMethod("nvfp4", modelopt=True)
    if ct is not None and ct.weights == "int4":
        return CtInt4MoEMethod(config.int4_config(ct), ct.symmetric)
    if ct is not None and ct.weights == "int8":
        if ct.symmetric and not ct.packed and ct.strategy in ("channel", "tensor"):
            return Int8MoEMethod()
        raise ValueError(f"compressed-tensors INT8 weights for the experts of a mixture-of-experts layer "
                         f"({layer.prefix}) are supported symmetric, per channel or per tensor, "
                         f"`int-quantized` (the W8A8 presets); not {ct.strategy} scales"
                         f"{'' if ct.symmetric else ', asymmetric'}{', pack-quantized' if ct.packed else ''}")
    what = (f"compressed-tensors {ct.weights.upper()}" if ct is not None
            else f"ModelOpt {scheme or config.algo}" if config.name == "modelopt" else config.name.upper())
    raise ValueError(f"{what} weights for the experts of a mixture-of-experts layer "
                     f"({layer.prefix}) are not supported")


class UnplacedExperts(MoEMethod):
    """Experts built in a scheme that has no expert method, in a checkpoint with several schemes:
    models/loader.place_schemes gives them the method of the scheme the checkpoint stores them in,
    or raises `error` where that is the built one. Holds no weights until then, only an empty tensor
    that goes where the layer goes (the CPU for an offloaded layer), for the weights to follow."""

    def __init__(self, error: ValueError) -> None:
        self.error = error

    def create_weights(self, layer: FusedMoE) -> None:
        layer.register_parameter("unplaced", nn.Parameter(torch.empty(0), requires_grad=False))

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        raise self.error


def linear_method_factory(config: QuantConfig | None) -> Callable[[nn.Module], LinearMethod | MoEMethod | None] | None:
    """Each layer's method: linear layers from their format's config, a MoE layer's experts from
    `moe_method`; an LM head's only where the format quantizes it (GPTQ's `lm_head: true`)."""
    if config is None:
        return None

    def method(layer: nn.Module) -> LinearMethod | MoEMethod | None:
        if isinstance(layer, FusedMoE):
            try:
                return moe_method(config, layer)
            except ValueError as e:   # the checkpoint may store the experts in another of its schemes
                if not hasattr(config, "scheme_for"):
                    raise
                return UnplacedExperts(e)
        if isinstance(layer, ParallelLMHead):   # the head stays in the dtype unless the checkpoint says otherwise
            return config.linear_method(layer) if getattr(config, "lm_head", False) else None
        assert isinstance(layer, LinearBase)
        return config.linear_method(layer)
    return method
