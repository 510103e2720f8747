"""FP4 (NVFP4 / MXFP4) mixture-of-experts weights, dequantized once after loading, as the FP4 linear
layers are (quantization/fp4.py): the checkpoint's values in the model dtype, not FP4's memory
saving. Per expert, as llm-compressor stores them (`experts.N.gate_proj.weight_packed`,
`.weight_scale`, NVFP4's `.weight_global_scale`) or NVIDIA ModelOpt does (`.weight`, `.weight_scale`,
`.weight_scale_2`). Once dequantized the layer is a plain one (its method drops away), so every
device runs it on the unquantized experts' kernels, the native CPU ones included."""
from __future__ import annotations

import torch
from torch import nn

from shardserve.layers.moe import FusedMoE, MoEMethod
from shardserve.quantization.fp4 import GROUP, dequantize


class Fp4MoEMethod(MoEMethod):
    def __init__(self, kind: str, modelopt: bool = False) -> None:
        self.kind, self.group = kind, GROUP[kind]   # "nvfp4" | "mxfp4"
        self.names = (("weight", "weight_scale_2", "input_scale") if modelopt
                      else ("weight_packed", "weight_global_scale", "input_global_scale"))
        self.global_multiplies = modelopt

    def create_weights(self, layer: FusedMoE) -> None:
        e, inter, hidden = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
        if hidden % self.group or inter % self.group:
            raise ValueError(f"{self.kind.upper()} experts of {layer.prefix}: {inter} intermediate rows per rank "
                             f"(hidden size {hidden}) are not a multiple of {self.group} (an FP4 scale's inputs); use "
                             "a smaller tensor_parallel_size or --enable-expert-parallel")
        self.dtype = torch.get_default_dtype()
        packed, global_name, input_name = self.names
        scale_dtype = torch.float8_e4m3fn if self.kind == "nvfp4" else torch.uint8
        for part, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
            layer.register_expert_param(f"{part}_{packed}", torch.empty(e, rows, cols // 2, dtype=torch.uint8))
            layer.register_expert_param(f"{part}_weight_scale", torch.empty(e, rows, cols // self.group,
                                                                            dtype=scale_dtype)).full_precision = True
            if self.kind == "nvfp4":   # one per expert projection, spread over its rows (gate and up: their own)
                layer.register_expert_param(f"{part}_{global_name}", torch.ones(e, rows), expert_scale=True)
            buf = torch.ones(e, rows)   # static FP4 activation scales: optional, read, not used
            layer.register_buffer(f"{part}_{input_name}", buf, persistent=False)
            buf.weight_loader, buf.expert_scale, buf.full_precision = layer.weight_loader, True, True

    def process_after_loading(self, layer: FusedMoE) -> None:
        packed, global_name, input_name = self.names
        weights = {}
        for part in ("w13", "w2"):
            stored = getattr(layer, f"{part}_weight_scale").data
            out = torch.empty(*stored.shape[:2], stored.shape[2] * self.group, dtype=self.dtype, device=stored.device)
            for expert in range(out.shape[0]):   # one expert at a time: the fp32 temporaries stay one expert's size
                per_row = (getattr(layer, f"{part}_{global_name}").data[expert].float()[:, None]
                           if self.kind == "nvfp4" else None)
                out[expert] = dequantize(getattr(layer, f"{part}_{packed}").data[expert], stored[expert], self.kind,
                                         per_row, self.global_multiplies)
            weights[part] = out
            for name in (packed, "weight_scale", global_name, input_name):
                if hasattr(layer, f"{part}_{name}"):
                    delattr(layer, f"{part}_{name}")
        layer.w13_weight = nn.Parameter(weights["w13"], requires_grad=False)
        layer.w2_weight = nn.Parameter(weights["w2"], requires_grad=False)
        layer.quant_method = None   # plain experts from here on

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("FP4 experts run once dequantized (process_after_loading)")
