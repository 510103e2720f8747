"""What a model needs from its HF config, read once into a frozen, typed spec.

`LlamaSpec.from_hf(config)` is the only place that reads config.json keys (or the HF-style config a
GGUF file's metadata gives) for the Llama family, and the only place that looks at the architecture
name: the differences between the members become plain fields (`qkv_bias`, `qk_norm`, ...), so the
modules take the spec and never branch on a name or repeat a default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and scaling from either the classic keys or transformers 5's `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling


def _sliding_window(cfg: dict[str, Any], layer: int) -> int | None:
    """The layer's attention window: Mistral's `sliding_window`, unless `use_sliding_window` is off
    (Qwen2) or `layer_types` makes this layer a full-attention one."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return None
    layer_types = cfg.get("layer_types")
    if layer_types and layer_types[layer] != "sliding_attention":
        return None
    return int(window)


_QK_NORM = {"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "full"}


@dataclass(frozen=True)
class MoeSpec:
    """The sparse MLP of a mixture-of-experts member (Qwen3-MoE, Mixtral, OLMoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int         # each expert's
    renormalize: bool              # rescale the top-k weights to sum to 1 (`norm_topk_prob`; Mixtral always)
    sparse_layers: tuple[bool, ...]   # per layer: experts (True) or the dense MLP (Qwen3-MoE's `mlp_only_layers`)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> MoeSpec | None:
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        if not num_experts:
            return None
        dense = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step") or 1
        return cls(
            num_experts=int(num_experts),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            renormalize=architecture == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob", False)),
            sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(cfg["num_hidden_layers"])),
        )


@dataclass(frozen=True)
class LlamaSpec:
    """The shape and switches of a Llama-family model (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3,
    SmolLM2) and of the mixture-of-experts models built the same way (Qwen3-MoE, Mixtral, OLMoE).
    Sizes are the full model's; the parallel layers divide them by the TP size."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None   # `llama3` / `linear`, as rotary.py reads it
    rope_freq_factors: tuple[float, ...] | None   # GGUF's per-frequency divisors (Llama 3.1 there)
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...]   # one per layer; None: full attention
    qkv_bias: bool          # Qwen2, or `attention_bias`
    o_bias: bool            # Llama's `attention_bias` also biases o_proj; Qwen2's does not
    mlp_bias: bool
    qk_norm: str | None     # RMSNorm on q and k before the rotary: "head" (Qwen3: per head), "full"
                            # (OLMoE: over all heads at once), None
    clip_qkv: float | None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv]
    tie_word_embeddings: bool
    moe: MoeSpec | None     # the experts of a mixture-of-experts model; None: every layer dense

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaSpec:
        """Read an HF config dict. Missing optional keys take HF's defaults for the architecture."""
        architecture = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        hidden_size = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        rope_theta, rope_scaling = _rope_settings(cfg)
        freq_factors = cfg.get("rope_freq_factors")
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_freq_factors=tuple(freq_factors) if freq_factors is not None else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            sliding_windows=tuple(_sliding_window(cfg, layer) for layer in range(num_layers)),
            qkv_bias=bool(cfg.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            o_bias=bool(cfg.get("attention_bias", False)) and architecture == "LlamaForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=_QK_NORM.get(architecture),
            clip_qkv=cfg.get("clip_qkv"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            moe=MoeSpec.from_hf(cfg, architecture),
        )
