"""The Llama family in one implementation: Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, SmolLM2.

Differences between the members are config switches: QKV bias (Qwen2), per-head q/k RMSNorm
(Qwen3), rope scaling (Llama 3.1), sliding windows (Mistral), tied embeddings (SmolLM2, small
Qwens). The model holds no communication code: sharding lives in the parallel layers.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from shardserve.distributed.parallel_state import get_pp_group, get_pp_layer_range, get_tensor_model_parallel_world_size
from shardserve.kernels.gemv import triton_gemv
from shardserve.layers.activation import SiluAndMul
from shardserve.layers.attention import Attention, AttentionContext, AttentionSpec
from shardserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryEmbedding
from shardserve.layers.vocab import ParallelLMHead, VocabParallelEmbedding


def rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and scaling from either the classic keys or transformers 5's `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling


def sliding_window_for_layer(cfg: dict[str, Any], layer: int) -> int | None:
    window = cfg.get("sliding_window")
    if not window:
        return None
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return None
    layer_types = cfg.get("layer_types")
    if layer_types and layer_types[layer] != "sliding_attention":
        return None
    return int(window)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer: int, arch: str) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        self.head_dim = cfg.get("head_dim") or hidden // heads
        qkv_bias = cfg.get("attention_bias", arch == "Qwen2ForCausalLM")
        o_bias = cfg.get("attention_bias", False) and arch == "LlamaForCausalLM"
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias=o_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.qk_norm = arch == "Qwen3ForCausalLM"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.get("rms_norm_eps", 1e-6))
            self.k_norm = RMSNorm(self.head_dim, cfg.get("rms_norm_eps", 1e-6))
        theta, scaling = rope_settings(cfg)
        self.rotary_emb = RotaryEmbedding(self.head_dim, cfg.get("max_position_embeddings", 8192), theta, scaling,
                                          cfg.get("rope_freq_factors"))
        self.attn = Attention(AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim,
                                            self.head_dim ** -0.5, sliding_window_for_layer(cfg, layer)))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: AttentionContext,
                reduce: bool = True) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(q, k, v, ctx, rotary=(self.rotary_emb, positions))
        return self.o_proj(out.reshape(out.shape[0], -1), reduce=reduce)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        bias = cfg.get("mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if gate_up.bias is None and triton_gemv.handles(x, gate_up.weight):
            # a few rows on CUDA: one kernel for both projections and the activation
            return self.down_proj(triton_gemv.gemv(x, gate_up.weight, gated=True), reduce=reduce)
        return self.down_proj(self.act(gate_up(x)), reduce=reduce)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer: int, arch: str) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = LlamaAttention(cfg, layer, arch)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = LlamaMLP(cfg)
        # With TP, the o_proj and down_proj outputs stay partial sums and the norm after each
        # all-reduces them (one kernel with the add and the norm where it can: fused_allreduce.py).
        self.defers_reduction = (get_tensor_model_parallel_world_size() > 1 and self.self_attn.o_proj.bias is None
                                 and self.mlp.down_proj.bias is None)
        # Whether the output leaves as a partial sum for the next layer's (or the final) norm; the
        # last layer of a pipeline stage before the last sends finished sums (LlamaModel sets it).
        self.output_partial = self.defers_reduction

    def forward(self, positions, hidden, residual, ctx, partial: bool = False):
        """partial: `hidden` is the previous layer's unreduced output (see defers_reduction)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, reduce=partial)
        defer = self.defers_reduction
        hidden = self.self_attn(positions, hidden, ctx, reduce=not defer)
        hidden, residual = self.post_attention_layernorm(hidden, residual, reduce=defer)
        return self.mlp(hidden, reduce=not self.output_partial), residual


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage: embeddings on the first stage, the final norm on
    the last, and only this stage's layers (others are placeholders so names keep their index)."""

    def __init__(self, cfg: dict[str, Any], arch: str) -> None:
        super().__init__()
        pp = get_pp_group()
        self.is_first, self.is_last = pp.is_first, pp.is_last
        self.start, self.end = get_pp_layer_range(cfg["num_hidden_layers"])
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"]) if self.is_first else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, arch) if self.start <= i < self.end else nn.Identity()
                                    for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)) if self.is_last else None
        if not self.is_last and self.end > self.start:   # the next stage gets finished sums
            self.layers[self.end - 1].output_partial = False

    def forward(self, input_ids, positions, ctx, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Returns the final hidden states on the last stage, (hidden, residual) elsewhere."""
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        partial = False
        for layer in self.layers[self.start:self.end]:
            hidden, residual = layer(positions, hidden, residual, ctx, partial)
            partial = layer.output_partial
        if not self.is_last:
            return hidden, residual if residual is not None else torch.zeros_like(hidden)
        hidden, _ = self.norm(hidden, residual, reduce=partial)
        return hidden


# Checkpoint names that land in a fused parameter: (checkpoint part, fused name, shard id).
_STACKED = [("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
            ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)]
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        self.config = cfg
        self.model = LlamaModel(cfg, arch)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"]) if self.model.is_last else None
        if self.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        return self.model(input_ids, positions, ctx, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers[self.model.start:self.model.end]]

    def _targets(self, name: str) -> list[str]:
        """The parameter names a checkpoint tensor feeds on this stage (none if another stage owns it)."""
        m = _LAYER_INDEX.match(name)
        if m and not self.model.start <= int(m.group(1)) < self.model.end:
            return []
        if name.startswith("model.embed_tokens."):
            targets = [name] if self.model.embed_tokens is not None else []
            if self.tie_word_embeddings and self.lm_head is not None and not targets:
                targets.append("lm_head.weight")   # the last stage's own copy of tied embeddings
            return targets
        if name.startswith("lm_head."):
            return [] if self.lm_head is None or self.tie_word_embeddings else [name]
        if name.startswith("model.norm.") and self.model.norm is None:
            return []
        return [name]

    def wants_weight(self, ckpt_name: str) -> bool:
        """Does this pipeline stage need the checkpoint tensor at all? (Lets the loader skip it unread.)"""
        return "rotary_emb.inv_freq" not in ckpt_name and bool(self._targets(ckpt_name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Feed checkpoint tensors (HF names) to the parameters' weight loaders, one at a time."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name:
                continue
            for name in self._targets(ckpt_name):
                shard_id = None
                for part, fused, sid in _STACKED:
                    if f".{part}." in name:
                        name, shard_id = name.replace(f".{part}.", f".{fused}."), sid
                        break
                param = params.get(name)
                if param is None:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter in "
                                     f"{type(self).__name__}")
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor.to(param.dtype), shard_id)
                loaded.add(name)
        missing = {n for n in params if n not in loaded}
        if self.tie_word_embeddings and self.model.embed_tokens is not None:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
