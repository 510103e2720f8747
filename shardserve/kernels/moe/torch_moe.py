"""The experts' matmuls in plain torch, grouped by expert: the CPU path (and CUDA without Triton).

The picks are sorted by expert so each expert that has tokens runs one matmul over all of them;
experts nobody picked cost nothing. Same conventions and result as kernels/moe/reference.py (which
loops over every expert with masks, in fp32); the matmuls here run in the weights' dtype, or in the
native CPU GEMM in fp32 where the experts are packed for it (4-D, cpu_ops.pack_experts), and the
picks are summed in fp32. The expert counts come to the host, so this is not for CUDA graphs.

FP8 experts (E4M3 with a scale per output row, `w13_scale` [E, 2 * I], `w2_scale` [E, H]) stay FP8
in memory: each expert that has tokens is widened to the activations' dtype only for its own matmul
(exact: every E4M3 value is a bf16 / fp16 / fp32 value) and its row scales applied to the output,
as the CUDA kernel's epilogue does (with block scales, `reference.BlockScales`, the expert is
dequantized with its blocks' scales for its own matmul instead). So the experts cost FP8 bytes at
rest plus one expert's widened copy at a time, instead of a full-precision copy of every expert.

INT4 experts (GPTQ / AWQ, `Int4Experts` of kernels/moe/int4_experts.py in place of w13 / w2): the
same, one expert dequantized to the activations' dtype for its own matmul (group scales and zeros
applied first), so memory stays at 4 bits plus one expert's width.

GGUF experts kept in their blocks (`GgufExperts`, kernels/moe/gguf_experts.py): every pick of the
layer in one kernel call where both stacks take the int8 kernels (quant_ops.moe_int8: the bits of
the loop below, without its Python per expert); otherwise each expert's matmul is the CPU block
kernel on that expert's blocks (fp32 out), w13 with its SiLU-and-mul in the kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.kernels.activation.reference import silu_and_mul
from shardserve.kernels.cpu import cpu_ops, quant_ops
from shardserve.kernels.moe.gguf_experts import GgufExperts
from shardserve.kernels.moe.int4_experts import Int4Experts
from shardserve.kernels.moe.reference import BlockScales

Experts = torch.Tensor | Int4Experts | GgufExperts


def _matmul(x: torch.Tensor, weights: Experts, expert: int, scale: torch.Tensor | BlockScales | None) -> torch.Tensor:
    if isinstance(weights, GgufExperts):   # the block kernel on this expert's blocks
        return weights.matmul(x, expert)
    if isinstance(weights, Int4Experts):   # dequantized for this matmul only
        return F.linear(x, weights.dequantize(expert, x.dtype))
    if isinstance(scale, BlockScales):     # FP8 with block scales: dequantized for this matmul only
        return F.linear(x, scale.expert_weight(weights, expert, x.dtype))
    if scale is not None:    # FP8: widened for this matmul only, row scales on the output
        return (F.linear(x, weights[expert].to(x.dtype)).float() * scale[expert]).to(x.dtype)
    if weights.dim() == 4:   # packed panels: fp32 math on the (often bf16) panels
        return cpu_ops.linear_packed(x, weights[expert], out_features=weights.out_features)
    return F.linear(x.to(weights.dtype), weights[expert])


def fused_moe(hidden: torch.Tensor, w13: Experts, w2: Experts,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_scale: torch.Tensor | BlockScales | None = None,
              w2_scale: torch.Tensor | BlockScales | None = None) -> torch.Tensor:
    if isinstance(w13, GgufExperts) and isinstance(w2, GgufExperts) and w13.one_call and w2.int8:
        return quant_ops.moe_int8(hidden, w13.blocks, w13.type_name, w2.blocks, w2.type_name, w2.k, topk_ids,
                                  topk_weights, w13.isa, w13.act).to(hidden.dtype)
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    flat = torch.where(flat < 0, num_experts, flat)   # picks held by other ranks sort last, unused
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    weights = topk_weights.reshape(-1)
    out = torch.zeros(hidden.shape[0], getattr(w2, "out_features", w2.shape[1]), dtype=torch.float32,
                      device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[start:start + count]
        start += count
        tokens = picks // top_k
        if isinstance(w13, GgufExperts):
            h = w13.gated(hidden[tokens], expert)
        else:
            h = silu_and_mul(_matmul(hidden[tokens], w13, expert, w13_scale))
        y = _matmul(h, w2, expert, w2_scale).float() * weights[picks].float().unsqueeze(1)
        out.index_add_(0, tokens, y)
    return out.to(hidden.dtype)
