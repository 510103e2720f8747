"""The Llama family in one implementation: Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, SmolLM2, and
the mixture-of-experts models built the same way (models/moe.py: Qwen3-MoE, Mixtral, OLMoE).

Differences between the members are fields of `LlamaSpec` (models/spec.py): QKV bias (Qwen2),
per-head q/k RMSNorm (Qwen3), rope scaling (Llama 3.1), sliding windows (Mistral), tied embeddings
(SmolLM2, small Qwens), experts in place of the dense MLP (`spec.moe`). The model holds no
communication code and calls no kernels: sharding and kernel choice live in the layers, weight
routing in models/loader.py (`load_weights`), which reads `packed_modules_mapping` and
`checkpoint_targets` here.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from shardserve.distributed.parallel_state import get_pp_group, get_pp_layer_range
from shardserve.layers.attention import Attention, AttentionContext, AttentionSpec
from shardserve.layers.cpu_offload import maybe_offload
from shardserve.layers.linear import QKVParallelLinear, RowParallelLinear
from shardserve.layers.mlp import GatedMLP
from shardserve.layers.moe import SparseMoeBlock
from shardserve.layers.norm import RMSNorm, ShardedRMSNorm
from shardserve.layers.rotary import RotaryEmbedding
from shardserve.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from shardserve.models import cpu_stack
from shardserve.models.spec import LlamaSpec
from shardserve.quantization.kv_scales import kv_scale_targets


class LlamaAttention(nn.Module):
    def __init__(self, spec: LlamaSpec, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, self.head_dim, spec.num_attention_heads,
                                          spec.num_key_value_heads, bias=spec.qkv_bias)
        self.o_proj = RowParallelLinear(spec.num_attention_heads * self.head_dim, spec.hidden_size, bias=spec.o_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.qk_norm, self.clip_qkv = spec.qk_norm, spec.clip_qkv
        if self.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
        elif self.qk_norm == "full":   # over all heads, which TP splits across ranks
            qkv, tp = self.qkv_proj, self.qkv_proj.tp_size
            self.q_norm = ShardedRMSNorm(spec.num_attention_heads * self.head_dim, qkv.tp_rank, tp, spec.rms_norm_eps)
            kv_shards = tp // qkv.kv_replicas
            self.k_norm = ShardedRMSNorm(spec.num_key_value_heads * self.head_dim, qkv.tp_rank // qkv.kv_replicas,
                                         kv_shards, spec.rms_norm_eps, qkv.kv_replicas)
        self.rotary_emb = rotary   # one for all layers (its cos/sin tables: 4 MiB a layer at 8K positions)
        self.attn = Attention(AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim,
                                            self.head_dim ** -0.5, spec.sliding_windows[layer]))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: AttentionContext,
                partial_sum: bool = False) -> torch.Tensor:
        """partial_sum: o_proj's output stays this rank's partial sum (layers/linear.py)."""
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:   # after the full q/k norm, as OLMoE does
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(q, k, v, ctx, rotary=(self.rotary_emb, positions))
        return self.o_proj(out.reshape(out.shape[0], -1), partial_sum=partial_sum)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = LlamaAttention(spec, layer, rotary)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        moe = spec.moe
        if moe is not None and moe.sparse_layers[layer]:
            self.mlp = SparseMoeBlock(spec.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                                      moe.renormalize, prefix=f"model.layers.{layer}.mlp")
        else:
            self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        # With TP, o_proj and the MLP hand partial sums to the norm after each, which all-reduces
        # them (with the add and the norm in one kernel where it can: layers/linear.py's docstring).
        self.partial_sums = self.self_attn.o_proj.supports_partial_sum and self.mlp.supports_partial_sum
        # Whether the output leaves as a partial sum for the next layer's (or the final) norm; the
        # last layer of a pipeline stage before the last sends finished sums (LlamaModel sets it).
        self.output_partial_sum = self.partial_sums

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                ctx: AttentionContext, input_partial_sum: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """input_partial_sum: `hidden` is the previous layer's partial sum (its output_partial_sum)."""
        # Each norm may hand the matmul after it FP8 rows (quantized in the norm's kernel; layers/norm.py).
        qkv = self.self_attn.qkv_proj
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, quant_for=qkv)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, partial_sum=input_partial_sum, quant_for=qkv)
        hidden = self.self_attn(positions, hidden, ctx, partial_sum=self.partial_sums)
        gate_up = self.mlp.gate_up_proj if isinstance(self.mlp, GatedMLP) else None
        hidden, residual = self.post_attention_layernorm(hidden, residual, partial_sum=self.partial_sums,
                                                         quant_for=gate_up)
        return self.mlp(hidden, partial_sum=self.output_partial_sum), residual


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage: embeddings on the first stage, the final norm on
    the last, and only this stage's layers (others are placeholders so names keep their index)."""

    def __init__(self, spec: LlamaSpec) -> None:
        super().__init__()
        pipeline = get_pp_group()
        self.is_first, self.is_last = pipeline.is_first, pipeline.is_last
        self.start, self.end = get_pp_layer_range(spec.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size) if self.is_first else None
        rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling,
                                 spec.rope_freq_factors)
        self.layers = nn.ModuleList(maybe_offload(LlamaDecoderLayer(spec, i, rotary)) if self.start <= i < self.end
                                    else nn.Identity()
                                    for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if self.is_last else None
        if not self.is_last and self.end > self.start:   # the next stage gets finished sums
            self.layers[self.end - 1].output_partial_sum = False
        # The layers as one native call on the CPU where they qualify (models/cpu_stack.py); not a
        # submodule (it holds the same layers), decided once the KV pool is bound.
        self._cpu_stack = (cpu_stack.CpuDecoderStack(list(self.layers[self.start:self.end]), rotary, spec.rms_norm_eps)
                           if self.end > self.start and cpu_stack.enabled() else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Returns the final hidden states on the last stage, (hidden, residual) elsewhere."""
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        partial_sum = False
        done = self._cpu_stack.run(positions, hidden, residual, ctx) if self._cpu_stack is not None else None
        if done is not None:
            hidden, residual = done
        else:
            for layer in self.layers[self.start:self.end]:
                hidden, residual = layer(positions, hidden, residual, ctx, partial_sum)
                partial_sum = layer.output_partial_sum
        if not self.is_last:
            return hidden, residual if residual is not None else torch.zeros_like(hidden)
        hidden, _ = self.norm(hidden, residual, partial_sum=partial_sum)
        return hidden


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensors that land in a slice of a fused parameter (models/loader.py's load_weights).
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.spec = spec = LlamaSpec.from_hf(config)
        self.model = LlamaModel(spec)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size) if self.model.is_last else None
        if spec.tie_word_embeddings and self.lm_head is not None and self.lm_head.linear is not None:
            raise ValueError("the checkpoint quantizes the LM head (quantization_config.lm_head=true) but ties it "
                             "to the embedding (tie_word_embeddings=true); only untied quantized heads are supported")
        if spec.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.weight.tied = True   # one table for both: a GPU keeps it dense (layers/vocab.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        return self.model(input_ids, positions, ctx, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def idle_step(self, dtype: torch.dtype, device: torch.device) -> None:
        """A step with no tokens, for a data-parallel replica whose experts other replicas use
        (expert parallelism across replicas): every MoE layer's token exchange, in layer order, so
        the busy replicas' layers find their peers (layers/moe.py)."""
        empty = torch.empty(0, self.spec.hidden_size, dtype=dtype, device=device)
        for layer in self.model.layers[self.model.start:self.model.end]:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp(empty)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers[self.model.start:self.model.end]]

    def checkpoint_targets(self, checkpoint_name: str) -> list[str]:
        """The parameter names (checkpoint spelling, before packing) that a checkpoint tensor feeds
        on this pipeline stage: none if another stage holds it or it is no parameter; with tied
        embeddings, a last stage that lacks the embedding table loads its LM head from it."""
        if "rotary_emb.inv_freq" in checkpoint_name:   # a buffer some HF checkpoints carry
            return []
        layer = _LAYER_INDEX.match(checkpoint_name)
        if layer and not self.model.start <= int(layer.group(1)) < self.model.end:
            return []
        scales = kv_scale_targets(checkpoint_name)   # an FP8 checkpoint's KV-cache scales
        if scales is not None:
            return scales
        if checkpoint_name.startswith("model.embed_tokens."):
            if self.model.embed_tokens is not None:
                return [checkpoint_name]
            return ["lm_head.weight"] if self.spec.tie_word_embeddings and self.lm_head is not None else []
        if checkpoint_name.startswith("lm_head."):
            if self.lm_head is None or self.spec.tie_word_embeddings:
                return []
            return [self.lm_head.parameter_name(checkpoint_name)]
        if checkpoint_name.startswith("model.norm.") and self.model.norm is None:
            return []
        return [checkpoint_name]
