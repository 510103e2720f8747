"""The mixture-of-experts members of the Llama family: Qwen3-MoE, Mixtral and OLMoE.

They are LlamaForCausalLM with experts in place of the dense MLP (`LlamaSpec.moe`, layers/moe.py);
what is left here is how their checkpoints name the experts' tensors:
- per expert, as HF checkpoints have them: `mlp.experts.7.gate_proj.weight` (Qwen3-MoE, OLMoE),
  `block_sparse_moe.experts.7.w1.weight` (Mixtral: w1 gate, w3 up, w2 down);
- all experts stacked in one tensor: transformers 5's `mlp.experts.gate_up_proj` / `down_proj`, and
  the GGUF loader's `mlp.experts.gate_proj` / `up_proj` / `down_proj`.
`expert_shard` turns such a name into the stacked parameter and the (expert, kind) shard id
FusedMoE.weight_loader takes (models/loader.py's load_weights asks it before packing names). FP8
checkpoints add per expert `...gate_proj.weight_scale` and `...gate_proj.input_scale` beside the
weight: they go to `w13_weight_scale` / `w13_input_scale` (w2_ for down) with the same shard id.
GPTQ / AWQ checkpoints have per expert `...gate_proj.qweight`, `.qzeros`, `.scales` (and GPTQ's
`.g_idx`) instead of `.weight`: they go to `w13_qweight` ... (quantization/int4_moe.py); AutoGPTQ
may add a `.bias` of zeros per expert projection, read and checked there (`w13_bias`). compressed-tensors'
INT4 experts have `.weight_packed`, `.weight_scale`, `.weight_zero_point`, `.weight_shape` (and
`.weight_g_idx` with activation order; quantization/compressed_tensors.py).
"""
from __future__ import annotations

import re

from shardserve.models.llama import LlamaForCausalLM

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\."
                         r"(weight|weight_scale|weight_scale_inv|input_scale|qweight|qzeros|scales|g_idx|bias"
                         r"|weight_packed|weight_zero_point|weight_shape|weight_g_idx"
                         r"|weight_global_scale|input_global_scale|weight_scale_2)$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")
_STACKED_KINDS = {"gate_up_proj": "gate_up", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class MoeForCausalLM(LlamaForCausalLM):
    expert_weight_kinds = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def expert_shard(self, name: str) -> tuple[str, tuple[int | None, str]] | None:
        """(parameter name, (expert, kind)) for an expert tensor's name; None for any other tensor."""
        match = _PER_EXPERT.match(name)
        if match and match.group(3) in self.expert_weight_kinds:
            kind = self.expert_weight_kinds[match.group(3)]
            param = f"{'w2' if kind == 'down' else 'w13'}_{match.group(4)}"
            return f"{match.group(1)}.{param}", (int(match.group(2)), kind)
        match = _STACKED.match(name)
        if match:
            kind = _STACKED_KINDS[match.group(2)]
            return f"{match.group(1)}.{'w2' if kind == 'down' else 'w13'}_weight", (None, kind)
        return None

    @classmethod
    def expert_checkpoint_names(cls, experts: str, expert: int) -> list[str]:
        """The checkpoint's names of one expert's matrices in the FusedMoE named `experts` (a
        quantization config names layers as the checkpoint does: models/loader.place_schemes, and
        the planner sizing them: planner/catalog.checkpoint_expert_bytes)."""
        return [f"{experts}.{expert}.{proj}" for proj in cls.expert_weight_kinds]


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass


class OlmoeForCausalLM(MoeForCausalLM):
    pass


class MixtralForCausalLM(MoeForCausalLM):
    expert_weight_kinds = {"w1": "gate", "w3": "up", "w2": "down"}

    def checkpoint_targets(self, checkpoint_name: str) -> list[str]:
        return super().checkpoint_targets(checkpoint_name.replace(".block_sparse_moe.", ".mlp."))

    @classmethod
    def expert_checkpoint_names(cls, experts: str, expert: int) -> list[str]:
        return [n.replace(".mlp.", ".block_sparse_moe.") for n in super().expert_checkpoint_names(experts, expert)]
