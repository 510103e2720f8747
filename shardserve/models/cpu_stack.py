"""The Llama decoder layers of one model handed to the native CPU kernels as one call per step
(kernels/cpu/decoder_stack.py): the same kernels in the same order as the modules' forward, so the
same bits, without ~100 us of Python per layer. On by default where it applies;
`SHARDSERVE_CPU_DECODER_STACK=0` keeps the per-module calls.

It applies to fp32 activations on the native CPU kernels (the default CPU path) with the native
attention backend, one tensor-parallel rank, and layers the C side knows: the gated MLP without
bias, per-head q/k norms (Qwen3) or none, no clipping, no bias on o_proj, every matmul one native
kernel (packed panels, GGUF blocks; a fused layer of GGUF parts of different types: one per run of
rows of a type, chained). MoE layers too (Qwen3-MoE, Mixtral) where their experts run
as one kernel call (GGUF blocks with the int8 kernels), every expert on this rank, the router one
native kernel without bias, and the C routing gives torch's bits here (layers/moe.py's
SparseMoeBlock.stack_moe). Anything else runs the modules, as before.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from shardserve.kernels.cpu import cpu_ops
from shardserve.kernels.cpu.decoder_stack import DecoderStack, LayerParts
from shardserve.layers.attention.cpu_native import NativeAttentionMetadata
from shardserve.layers.mlp import GatedMLP
from shardserve.layers.moe import SparseMoeBlock

logger = logging.getLogger("shardserve")

SWITCH = "SHARDSERVE_CPU_DECODER_STACK"


def enabled() -> bool:
    value = os.environ.get(SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH}={value!r}: use 1 (decoder layers in one native call) or 0 (one call per kernel)")
    return value == "1"


def _parts(layer: nn.Module, eps: float) -> LayerParts | str:
    """What the C stack needs of one LlamaDecoderLayer, or why it cannot take it (eps: the stack's,
    which every norm must share)."""
    attn, mlp = layer.self_attn, layer.mlp
    if layer.partial_sums or layer.output_partial_sum:
        return "tensor parallelism"
    if attn.qk_norm not in (None, "head") or attn.clip_qkv is not None or attn.o_proj.bias is not None:
        return "q/k norms over all heads, clipping or an o_proj bias"
    moe = None
    if type(mlp) is SparseMoeBlock:   # exactly: a subclass may add what the C side does not do
        moe = mlp.stack_moe()
        if isinstance(moe, str):
            return moe
        gate_up = down = None
    elif isinstance(mlp, GatedMLP) and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None:
        gate_up = mlp.gate_up_proj.stack_linear(gated=True) or mlp.gate_up_proj.stack_linear()
        down = mlp.down_proj.stack_linear()
        if gate_up is None or down is None:
            return "a matmul that is not one native kernel"
    else:
        return "an MLP other than the gated one without bias or the sparse one"
    linears = (attn.qkv_proj.stack_linear(), attn.o_proj.stack_linear(), gate_up, down)
    if linears[0] is None or linears[1] is None:
        return "a matmul that is not one native kernel"
    head_norms = [attn.q_norm, attn.k_norm] if attn.qk_norm == "head" else [None, None]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, *head_norms]
    if any(n is not None and (n.weight.dtype != torch.float32 or not n.weight.is_contiguous() or n.eps != eps)
           for n in norms):
        return "norm weights not fp32, or norms with different eps"
    kv, spec = attn.attn.kv_cache, attn.attn.spec
    if kv.dim() != 5 or kv.dtype not in cpu_ops.KV_KINDS or not kv.is_contiguous():
        return "no native KV pool bound"
    return LayerParts(*(None if n is None else n.weight for n in norms), *linears, kv_cache=kv,
                      window=spec.sliding_window or 0, k_scale=spec.k_scale, v_scale=spec.v_scale, moe=moe)


class CpuDecoderStack:
    """Decides once per KV pool whether a model's layers run as one native call, and runs them."""

    def __init__(self, layers: list[nn.Module], rotary: nn.Module, eps: float) -> None:
        self.layers, self.rotary, self.eps = layers, rotary, eps
        self.stack: DecoderStack | None = None
        self.pool_ptr: int | None = None   # the pool the decision was made for

    def _build(self) -> DecoderStack | None:
        parts = [_parts(layer, self.eps) for layer in self.layers]
        why = next((p for p in parts if isinstance(p, str)), None)
        first = self.layers[0]
        if why is not None:
            logger.debug("CPU: decoder layers called one kernel at a time (%s)", why)
            return None
        attn = first.self_attn
        logger.info("CPU: decoder layers run as one native call per step (%s=0: one call per kernel)", SWITCH)
        inter = max((layer.mlp.down_proj.input_size for layer in self.layers if isinstance(layer.mlp, GatedMLP)),
                    default=0)   # the dense MLPs' (a MoE model's dense layers; none: 0)
        return DecoderStack(parts, first.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads,
                            attn.head_dim, inter, self.eps, attn.attn.spec.scale, self.rotary.cos, self.rotary.sin)

    def run(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, ctx
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the layers, or None where the modules must run this step."""
        md = ctx.metadata
        if (not isinstance(md, NativeAttentionMetadata) or hidden.dtype != torch.float32 or hidden.device.type != "cpu"
                or hidden.dim() != 2 or not hidden.is_contiguous() or positions.dtype != torch.int64
                or (residual is not None and (residual.dtype != torch.float32 or not residual.is_contiguous()))):
            return None
        pool = self.layers[0].self_attn.attn.kv_cache.data_ptr()
        if pool != self.pool_ptr:
            self.stack, self.pool_ptr = self._build(), pool
        if self.stack is None:
            return None
        return self.stack.run(hidden, residual, positions.contiguous(), md.slots.contiguous(), md.block_tables,
                              md.seq_lens)
