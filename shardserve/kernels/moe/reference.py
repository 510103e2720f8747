"""Mixture-of-experts in plain torch: the oracle every MoE path is checked against.

Conventions shared by every implementation (kernels/moe/*, layers/moe.py):
- `w13` [E, 2 * I, H]: each expert's gate rows then its up rows (HF's gate_proj / up_proj stacked);
  `w2` [E, H, I]: each expert's down projection. E, I are this rank's experts and intermediate size.
- `topk_ids` [T, K] (int): the expert each of a token's K picks goes to, as an index into this
  rank's experts; -1 marks a pick held by another expert-parallel rank (it adds nothing here).
- `topk_weights` [T, K] (fp32): the routing weight of each pick, applied to that expert's output
  before the picks are summed.
- FP8 experts: `w13` / `w2` in float8_e4m3fn with fp32 scales per output row, `w13_scale` [E, 2 * I]
  and `w2_scale` [E, H]: the expert's weight is q * scale[:, None] (`dequantize_experts`); or, for
  checkpoints with block-wise scales, a `BlockScales` in place of each (one multiplier per block of
  output rows x `block_k` inputs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardserve.kernels.quant.reference import fp8_block_weight


@dataclass
class BlockScales:
    """Block-wise scales of FP8 experts [E, N, K]: `scales` fp32 [E, R, ceil(K / block_k)] (each
    expert's distinct scale rows) and `scale_row` int32 [N] (each output row's index into them, the
    same for every expert: experts are cut into blocks alike), as kernels/quant/triton_fp8_block.py
    lays out one linear's."""
    scales: torch.Tensor
    scale_row: torch.Tensor
    block_k: int
    uniform_rows: int = 1   # each part's rows share one scale row in aligned runs of this many (`uniform_rows`)

    def expert_weight(self, weights: torch.Tensor, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """One expert's E4M3 [N, K] -> its weight in `dtype` (computed in fp32, rounded once)."""
        return fp8_block_weight(weights[expert], self.scales[expert], self.scale_row, self.block_k, dtype)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, the top-k picks, and (renormalize) their weights rescaled to
    sum to 1: Qwen3-MoE / OLMoE with `norm_topk_prob`, and Mixtral (whose top-k of the logits, then
    softmax over the k, is the same thing). Returns (topk_weights fp32 [T, K], topk_ids int32 [T, K])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def uniform_rows(scale_row: torch.Tensor, parts: int, largest: int = 128) -> int:
    """The longest power-of-two run (up to `largest`) over which `scale_row`, cut into `parts` equal fused
    parts, keeps one value in every aligned run of each part: the fused MoE kernel then loads one
    scale per output tile instead of one per column."""
    part = scale_row.shape[0] // parts
    run = largest
    while run > 1:
        if part % run == 0 and bool((scale_row.view(-1, run) == scale_row.view(-1, run)[:, :1]).all()):
            return run
        run //= 2
    return 1


def dequantize_experts(weights: torch.Tensor, scale: torch.Tensor | BlockScales) -> torch.Tensor:
    """FP8 experts [E, N, K] with row scales [E, N] (or block scales) -> their fp32 values."""
    if isinstance(scale, BlockScales):
        return torch.stack([scale.expert_weight(weights, e, torch.float32) for e in range(weights.shape[0])])
    return weights.float() * scale.float().unsqueeze(-1)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | BlockScales | None = None,
              w2_scale: torch.Tensor | BlockScales | None = None) -> torch.Tensor:
    """hidden [T, H] -> [T, H]: sum over picks of weight * down(silu(gate(x)) * up(x)), each expert
    computed on the tokens that picked it, in fp32, rounded once to hidden's dtype. With scales,
    the FP8 experts are dequantized first."""
    if w13_scale is not None:
        w13, w2 = dequantize_experts(w13, w13_scale), dequantize_experts(w2, w2_scale)
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float32, device=hidden.device)
    inter = w2.shape[2]
    for expert in range(w13.shape[0]):
        tokens, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        x = hidden[tokens].float()
        gate_up = x @ w13[expert].float().t()
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = h @ w2[expert].float().t()
        out.index_add_(0, tokens, y * topk_weights[tokens, slot].float().unsqueeze(1))
    return out.to(hidden.dtype)
