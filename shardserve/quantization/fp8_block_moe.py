"""MoE experts of FP8 checkpoints with block-wise scales (`weight_block_size`, e.g. [128, 128]:
Qwen3-30B-A3B-FP8, Qwen3-235B-A22B-FP8): per expert `experts.N.gate_proj.weight` in E4M3 beside
`experts.N.gate_proj.weight_scale_inv`, one fp32 multiplier per block of BN output rows x BK inputs.

- Stored: w13 [E, 2 * I, H] and w2 [E, H, I] in E4M3 (half the bytes of bf16; the experts are most of
  a MoE model), with each expert's scales compact: `w13_weight_scale_inv` [E, R13, ceil(H / BK)] holds
  the block rows this rank's gate rows touch, then its up rows', and `w13_scale_row` [2 * I] int32
  points each output row at its block row (the same for every expert); `w2_weight_scale_inv` [E,
  ceil(H / BN), I / BK] and `w2_scale_row` [H] likewise (kernels/moe/reference.py `BlockScales`).
- Sharding: TP cuts every expert's intermediate rows; gate/up may start inside a block (the row map
  handles it), but down's inputs per rank must be a multiple of BK, or the layer is refused when it
  is built (as for dense row-parallel layers, quantization/fp8_block.py); expert parallelism hands
  whole experts with their scales to each rank.
- Running: CUDA (8.9+) on the fused Triton kernel, which scales each K step's product by its block's
  scales (kernels/moe/triton_moe.py): for decode the E4M3 tiles widen in registers (W8A16), for
  prefill-sized batches the activations are quantized per token and 128 inputs and the dots run in
  FP8 (W8A8, as the dense block layers' prefill); the CPU keeps the experts in E4M3 and dequantizes
  one expert at a time for its own matmul (kernels/moe/torch_moe.py). GPUs before 8.9 (no E4M3 in
  Triton there) widen the experts once after loading into the model dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels.moe.reference import BlockScales, uniform_rows
from shardserve.layers.moe import FusedMoE, MoEMethod, experts_matmul
from shardserve.utils import cdiv

FP8 = torch.float8_e4m3fn


class Fp8BlockMoEMethod(MoEMethod):
    def __init__(self, block: tuple[int, int], scale_name: str = "weight_scale_inv") -> None:
        self.block_n, self.block_k = block
        self.scale_name = scale_name   # the checkpoint's name for the scales (compressed-tensors: weight_scale)

    def _gate_blocks(self, layer: FusedMoE) -> tuple[int, torch.Tensor]:
        """(first block row, each local gate row's block row counted from it) of this rank's gate
        (or up) rows: the rows from inter_rank * I, cut out of the full part's grid of blocks."""
        start, inter = layer.inter_rank * layer.intermediate_size, layer.intermediate_size
        first = start // self.block_n
        return first, torch.arange(start, start + inter) // self.block_n - first

    def create_weights(self, layer: FusedMoE) -> None:
        bn, bk = self.block_n, self.block_k
        e, inter, hidden = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
        if layer.inter_shards > 1 and inter % bk:
            raise ValueError(f"{layer.prefix}: tensor_parallel_size={layer.inter_shards} gives each rank {inter} of "
                             f"the experts' {inter * layer.inter_shards} intermediate inputs, not a multiple of the "
                             f"checkpoint's FP8 blocks of {bk}: the ranks would cut blocks in two; choose a size "
                             "that keeps them whole, or --enable-expert-parallel")
        self.dtype = torch.get_default_dtype()   # the model's: what the experts widen to where FP8 cannot run
        layer.register_expert_param("w13_weight", torch.empty(e, 2 * inter, hidden, dtype=FP8))
        layer.register_expert_param("w2_weight", torch.empty(e, hidden, inter, dtype=FP8))
        _, gate_rows = self._gate_blocks(layer)
        part_rows = int(gate_rows[-1]) + 1
        w13_rows = torch.cat([gate_rows, gate_rows + part_rows]).to(torch.int32)
        scales = {"w13": torch.ones(e, 2 * part_rows, cdiv(hidden, bk), dtype=torch.float32),
                  "w2": torch.ones(e, cdiv(hidden, bn), cdiv(inter, bk), dtype=torch.float32)}
        for name, data in scales.items():
            param = layer.register_expert_param(f"{name}_{self.scale_name}", data)
            param.full_precision = True   # fp32 as they are; filled by `_load_scales`
            param.weight_loader = lambda p, loaded, shard_id: self._load_scales(layer, p, loaded, shard_id)
        layer.register_buffer("w13_scale_row", w13_rows)
        layer.register_buffer("w2_scale_row", (torch.arange(hidden) // bn).to(torch.int32))

    def _load_scales(self, layer: FusedMoE, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: tuple[int | None, str]) -> None:
        """One expert's block grid ([ceil(rows / BN), ceil(inputs / BK)] of the full tensor) -> the
        block rows (gate, up) or block columns (down) this rank's part of the expert uses."""
        expert, kind = shard_id
        if expert is None:
            raise ValueError(f"{layer.prefix}: block scales of all experts in one tensor are not read; expected one "
                             f"{self.scale_name} per expert")
        local = expert - layer.expert_start
        if not 0 <= local < layer.num_local_experts:
            return   # another expert-parallel rank's expert
        if kind not in ("gate", "up", "down"):
            raise ValueError(f"{layer.prefix}: block scales for expert weight kind {kind!r} are not read")
        bn, bk = self.block_n, self.block_k
        full_inter, hidden = layer.intermediate_size * layer.inter_shards, layer.hidden_size
        rows, cols = (full_inter, hidden) if kind in ("gate", "up") else (hidden, full_inter)
        if tuple(loaded.shape) != (cdiv(rows, bn), cdiv(cols, bk)):
            raise ValueError(f"{layer.prefix}: expert {expert}'s {kind} {self.scale_name} has shape "
                             f"{tuple(loaded.shape)}; blocks of {[bn, bk]} over [{rows}, {cols}] need "
                             f"{[cdiv(rows, bn), cdiv(cols, bk)]}")
        if kind == "down":   # the inputs this rank holds (whole blocks: create_weights checked)
            inter = layer.intermediate_size
            first = layer.inter_rank * inter // bk
            param.data[local].copy_(loaded[:, first:first + param.shape[2]])
            return
        first, part_rows = layer.inter_rank * layer.intermediate_size // bn, param.shape[1] // 2
        offset = 0 if kind == "gate" else part_rows
        param.data[local, offset:offset + part_rows].copy_(loaded[first:first + part_rows])

    def process_after_loading(self, layer: FusedMoE) -> None:
        if self.scale_name != "weight_scale_inv":   # one name from here on, whatever the checkpoint's
            for name in ("w13", "w2"):
                scales = getattr(layer, f"{name}_{self.scale_name}")
                delattr(layer, f"{name}_{self.scale_name}")
                layer.register_parameter(f"{name}_weight_scale_inv", scales)
        # How many consecutive rows of each part share a scale row (128 for 128-row blocks on block
        # boundaries): the kernel then loads one scale per tile of outputs.
        layer.w13_uniform_rows = uniform_rows(layer.w13_scale_row, 2)
        layer.w2_uniform_rows = uniform_rows(layer.w2_scale_row, 1)
        w13 = layer.w13_weight.data
        if w13.is_cuda and torch.cuda.get_device_capability(w13.device) < (8, 9):
            for name in ("w13", "w2"):   # widened once: plain experts of the model dtype from here on
                weights, scales = getattr(layer, f"{name}_weight"), self.scales(layer, name)
                widened = torch.stack([scales.expert_weight(weights.data, e, self.dtype)
                                       for e in range(weights.shape[0])])
                setattr(layer, f"{name}_weight", nn.Parameter(widened, requires_grad=False))
                delattr(layer, f"{name}_weight_scale_inv")
                delattr(layer, f"{name}_scale_row")

    def scales(self, layer: FusedMoE, name: str) -> BlockScales:
        return BlockScales(getattr(layer, f"{name}_weight_scale_inv"), getattr(layer, f"{name}_scale_row"),
                           self.block_k, getattr(layer, f"{name}_uniform_rows", 1))

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if layer.w13_weight.dtype != FP8:   # widened after loading
            return experts_matmul(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        return experts_matmul(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                              self.scales(layer, "w13"), self.scales(layer, "w2"))
