"""Maps a checkpoint's `architectures` entry to the class that implements it."""
from __future__ import annotations

from typing import Any

from torch import nn

from shardserve.models.llama import LlamaForCausalLM
from shardserve.models.moe import MixtralForCausalLM, OlmoeForCausalLM, Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(hf_config: dict[str, Any]) -> type[nn.Module]:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"model architecture {archs or '(none given in config.json)'} is not supported; "
                     f"supported architectures: {', '.join(supported_architectures())}")
