"""FP8 (E4M3) mixture-of-experts weights: the experts of `--quantization fp8` on a full-precision
checkpoint, and of FP8 checkpoints (`quant_method: fp8`, as AutoFP8 / vLLM write them for Mixtral
and Qwen3-MoE: per expert `experts.N.gate_proj.weight` in E4M3 beside `experts.N.gate_proj.weight_scale`,
one value per tensor or one per output channel, and optionally a static `input_scale`).

- Stored: w13 [E, 2 * I, H] and w2 [E, H, I] in float8_e4m3fn, with fp32 scales per output row of each
  expert (`w13_weight_scale` [E, 2 * I], `w2_weight_scale` [E, H]); a per-tensor checkpoint scale is
  spread over the rows it covers (so gate and up of one expert keep their own), a per-channel one
  taken as it is. They load and shard through FusedMoE's weight_loader (layers/moe.py): the gate/up
  scale rows are cut over TP with the weight's rows, whole experts with their scales over EP.
- `--quantization fp8`: the experts load in the model dtype, then are quantized once, expert by
  expert, absmax per row / 448 (as the dense layers, quantization/fp8.py).
- `input_scale` (static activation scales): read and dropped; activations are scaled dynamically
  where they are quantized at all.
- Running, CPU and CUDA alike, the experts stay FP8 in memory (half the bytes of bf16; the experts are
  most of a MoE model). CUDA: the fused Triton kernel reads E4M3 and scales in its epilogue
  (kernels/moe/triton_moe.py): weight-only (W8A16) for decode, FP8 activations scaled per token and
  128 inputs (W8A8) for prefill-sized batches; elsewhere the grouped torch path widens one expert at
  a time for its own matmul (kernels/moe/torch_moe.py), never the whole stack.
- Block-wise scales (`weight_block_size`, DeepSeek-V3 / Qwen3-FP8's `weight_scale_inv`):
  quantization/fp8_block_moe.py.
"""
from __future__ import annotations

import torch
from torch import nn

from shardserve.layers.moe import FusedMoE, MoEMethod, experts_matmul
from shardserve.quantization.fp8 import FP8, quantize_rows


class Fp8MoEMethod(MoEMethod):
    checkpoint_dtype = FP8   # the experts' type in a checkpoint (INT8's subclass, quantization/int8.py)

    def __init__(self, from_checkpoint: bool) -> None:
        self.from_checkpoint = from_checkpoint   # experts stored as FP8 (else quantized after loading)

    def create_weights(self, layer: FusedMoE) -> None:
        e, inter, hidden = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
        dtype = self.checkpoint_dtype if self.from_checkpoint else torch.get_default_dtype()
        layer.register_expert_param("w13_weight", torch.empty(e, 2 * inter, hidden, dtype=dtype))
        layer.register_expert_param("w2_weight", torch.empty(e, hidden, inter, dtype=dtype))
        if not self.from_checkpoint:
            return
        layer.register_expert_param("w13_weight_scale", torch.ones(e, 2 * inter, dtype=torch.float32),
                                    expert_scale=True)
        layer.register_expert_param("w2_weight_scale", torch.ones(e, hidden, dtype=torch.float32),
                                    expert_scale=True)
        # Static activation scales: optional (a dynamic-scheme checkpoint has none), read and dropped.
        # Buffers with a weight_loader are what models/loader.py fills when present.
        for name in ("w13_input_scale", "w2_input_scale"):
            buf = torch.ones(e, 2 * inter if name.startswith("w13") else hidden, dtype=torch.float32)
            layer.register_buffer(name, buf, persistent=False)
            buf.weight_loader, buf.expert_scale, buf.full_precision = layer.weight_loader, True, True

    def process_after_loading(self, layer: FusedMoE) -> None:
        if self.from_checkpoint:
            del layer.w13_input_scale, layer.w2_input_scale   # read, unused (the module docstring)
            return
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name).data
            e, rows, cols = weight.shape
            q = torch.empty(e, rows, cols, dtype=FP8, device=weight.device)
            scale = torch.empty(e, rows, dtype=torch.float32, device=weight.device)
            for expert in range(e):   # one expert at a time: the fp32 temporaries stay one expert's size
                q[expert], scale[expert] = quantize_rows(weight[expert])
            setattr(layer, name, nn.Parameter(q, requires_grad=False))
            setattr(layer, f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return experts_matmul(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                              layer.w13_weight_scale, layer.w2_weight_scale)
