"""A Llama-family decoder stack in one native call (csrc/decoder_stack.c): the Python side.

Each layer's matmuls are described once (`StackLinear`: packed panels here, GGUF blocks by
quant_ops.stack_linear; a MoE layer's router, routing and GGUF experts: `StackMoe`, the experts by
quant_ops.stack_experts, the routing by csrc/moe_route.c) and the stack (`StackModel`) is handed
to C with the step's activations and attention metadata; C calls the same kernels, in the same
order, as the modules would, so the result is bit for bit the same. The saving is the Python
between kernels: on the embedded 135M model that was ~3.5 ms of a ~9.5 ms decode step.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from shardserve.kernels.cpu import cpu_ops
from shardserve.kernels.cpu.moe_route import RouteFns, route_fns

PANELS, GGUF_INT8, GGUF_FP32 = 0, 1, 2   # decoder_stack.c's STACK_* kinds
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class StackLinear(ctypes.Structure):
    """One matmul (or one part of a layer's, chained through `next`: see chained)."""


StackLinear._fields_ = [("kind", _i64), ("w", _ptr), ("bias", _ptr), ("fn", _ptr), ("n", _i64), ("k", _i64),
                        ("wbf16", _i64), ("isa", _i64), ("type", _i64), ("levels", _i64), ("gated", _i64),
                        ("row_bytes", _i64), ("col", _i64), ("next", ctypes.POINTER(StackLinear))]


def chained(parts: list[StackLinear]) -> StackLinear:
    """One layer's matmul made of parts run in turn, each writing its n columns from its `col` of the
    one output (a fused layer whose parts differ in GGUF type). The result points into an array that
    it keeps alive (ctypes' base reference), as long as it, or a structure it is copied into, lives."""
    if len(parts) == 1:
        return parts[0]
    chain = (StackLinear * len(parts))(*parts)
    for i in range(len(parts) - 1):
        chain[i].next = ctypes.pointer(chain[i + 1])
    return chain[0]


class StackMoe(ctypes.Structure):
    """A MoE layer's router, routing and experts (the experts: quant_ops.stack_experts)."""

    _fields_ = [("router", StackLinear), ("experts", _i64), ("top_k", _i64), ("renormalize", _i64), ("fn", _ptr),
                ("w13", _ptr), ("w2", _ptr), ("w13_bytes", _i64), ("w2_bytes", _i64), ("inter", _i64),
                ("isa", _i64), ("type13", _i64), ("type2", _i64), ("levels", _i64)]


class StackLayer(ctypes.Structure):
    _fields_ = [("ln1", _ptr), ("ln2", _ptr), ("q_norm", _ptr), ("k_norm", _ptr), ("qkv", StackLinear),
                ("o", StackLinear), ("gate_up", StackLinear), ("down", StackLinear), ("k_cache", _ptr),
                ("v_cache", _ptr), ("window", _i64), ("k_scale", _f32), ("v_scale", _f32),
                ("moe", ctypes.POINTER(StackMoe))]


class StackModel(ctypes.Structure):
    _fields_ = [("layers", _i64), ("hidden", _i64), ("hq", _i64), ("hk", _i64), ("head_dim", _i64),
                ("inter", _i64), ("kv_kind", _i64), ("block_size", _i64), ("pool_slots", _i64),
                ("eps", _f32), ("scale", _f32), ("cos", _ptr), ("sin", _ptr), ("layer", ctypes.POINTER(StackLayer)),
                ("experts", _i64), ("top_k", _i64), ("route", RouteFns)]


def panels_linear(packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None) -> StackLinear | None:
    """A matmul on cpu_ops.pack_weight panels (bias fp32 [n]), or None if the tensors are not such."""
    if packed.dim() != 3 or packed.dtype not in (torch.bfloat16, torch.float32) or not packed.is_contiguous():
        return None
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    return StackLinear(kind=PANELS, w=packed.data_ptr(), bias=None if bias is None else bias.data_ptr(), n=n, k=k,
                       wbf16=int(packed.dtype == torch.bfloat16))


@dataclass
class LayerParts:
    """What one decoder layer hands the stack (all fp32 CPU tensors, contiguous)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    q_norm: torch.Tensor | None     # per-head q and k norms (Qwen3), or None
    k_norm: torch.Tensor | None
    qkv: StackLinear
    o: StackLinear
    gate_up: StackLinear | None     # gated=1: the kernel returns silu(gate) * up itself (None: moe)
    down: StackLinear | None
    kv_cache: torch.Tensor          # [2, Hk, blocks, block_size, D]
    window: int
    k_scale: float
    v_scale: float
    moe: StackMoe | None = None     # a MoE layer's sparse MLP in place of gate_up / down


class DecoderStack:
    """The stack's description in C structures, built once for a bound KV pool; `keep` holds every
    tensor whose address it uses."""

    def __init__(self, parts: list[LayerParts], hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, scale: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
        pool = parts[0].kv_cache
        self.keep = [cos, sin] + [t for p in parts for t in (p.kv_cache, p.ln1, p.ln2, p.q_norm, p.k_norm)
                                  if t is not None]
        layers = (StackLayer * len(parts))()
        moes = [p.moe for p in parts if p.moe is not None]
        for i, p in enumerate(parts):
            q_norm, k_norm = (None, None) if p.q_norm is None else (p.q_norm.data_ptr(), p.k_norm.data_ptr())
            mlp = {"moe": ctypes.pointer(p.moe)} if p.moe is not None else {"gate_up": p.gate_up, "down": p.down}
            layers[i] = StackLayer(ln1=p.ln1.data_ptr(), ln2=p.ln2.data_ptr(), q_norm=q_norm, k_norm=k_norm,
                                   qkv=p.qkv, o=p.o, k_cache=p.kv_cache[0].data_ptr(),
                                   v_cache=p.kv_cache[1].data_ptr(), window=p.window, k_scale=p.k_scale,
                                   v_scale=p.v_scale, **mlp)
        _, _, blocks, block_size, _ = pool.shape
        # (the MoE structures' memory and chained linears' parts, which `layers` points into)
        self.layers, self.moes, self.parts = layers, moes, parts
        experts, top_k = max((m.experts for m in moes), default=0), max((m.top_k for m in moes), default=0)
        route = route_fns() if moes else None
        assert route is not None or not moes, "MoE layers in the stack need the C routing (moe_route.route_fns)"
        self.model = StackModel(layers=len(parts), hidden=hidden, hq=num_heads, hk=num_kv_heads, head_dim=head_dim,
                                inter=intermediate, kv_kind=cpu_ops.KV_KINDS[pool.dtype], block_size=block_size,
                                pool_slots=blocks * block_size, eps=eps, scale=scale, cos=cos.data_ptr(),
                                sin=sin.data_ptr(), layer=layers, experts=experts, top_k=top_k,
                                route=route or RouteFns())
        # scratch floats per token (decoder_stack.c): the MoE picks' ids (int64), normed rows, qkv,
        # attention out, activation, gate_up, router logits, the picks' weights; then one row of
        # `experts` floats for the routing
        self.width = (3 * top_k + hidden + (num_heads + 2 * num_kv_heads) * head_dim + num_heads * head_dim
                      + 3 * intermediate + experts)
        self.experts = experts

    def scratch_floats(self, tokens: int) -> int:
        """The scratch decoder_stack.c takes for `tokens` tokens, in floats."""
        return tokens * self.width + self.experts

    def run(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, slots: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after every layer, as the modules' loop returns them. hidden: fp32 [T, H]
        (overwritten), residual: the running residual or None before the first layer of a model."""
        t = hidden.shape[0]
        has_residual = residual is not None
        if residual is None:
            residual = torch.empty_like(hidden)
        scratch = torch.empty(self.scratch_floats(t), dtype=torch.float32)
        rc = cpu_ops.decoder_stack(ctypes.byref(self.model), t, hidden.data_ptr(), residual.data_ptr(),
                                   int(has_residual), positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
                                   block_tables.stride(0), seq_lens.data_ptr(), scratch.data_ptr())
        if rc == -2:
            raise MemoryError(f"decoder stack: no memory for a GGUF kernel's int8 activations ({t} tokens)")
        if rc:
            raise RuntimeError(f"decoder stack: a GGUF kernel refused its arguments ({rc})")
        return hidden, residual
