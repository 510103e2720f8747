"""`plan --dtype bf16|fp8` counts the bytes the engine holds: the full-size Llama-3-8B and Qwen3-8B
shapes built (on the meta device, nothing allocated) as bf16 and FP8 checkpoints load them (what a
GPU keeps: E4M3 weights and their per-channel scales), every parameter and buffer summed, against
the planner's weight bytes. (INT4 is repacked on the GPU after loading, into the layout the
planner's int4 bytes describe; its figure is checked against the GPU benchmark's held bytes.)"""
from __future__ import annotations

import pytest
import torch

from shardserve.bench.shapes import shape_config
from shardserve.models.loader import build_model
from shardserve.planner.memory import ModelShape

FORMATS = {"bf16": None, "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"}}


def held_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}   # shared ones once
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("shape", ["llama-3-8b", "qwen3-8b"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_planner_weight_bytes_match_the_built_model(shape, fmt):
    config = shape_config(shape)
    if FORMATS[fmt] is not None:
        config = {**config, "quantization_config": FORMATS[fmt]}
    built = held_bytes(build_model(config, torch.bfloat16, torch.device("meta")))
    planned = ModelShape(config).weight_bytes(fmt, 1, range(config["num_hidden_layers"]), True, True)
    # What the planner leaves out: per-channel FP8 scales, the rotary table's few MiB. Within 0.5%
    # (each layer holding its own rotary table once cost 134 MB, 0.8%, on Llama-3-8B).
    assert abs(built / planned - 1) < 0.005, f"{shape} {fmt}: built {built / 2**30:.3f} GiB, plan {planned / 2**30:.3f}"


# MoE checkpoints whose experts are stored otherwise than their linears (the planning dtype):
# (shape, quantization_config, what a GPU holds the experts in)
_CT_FP8_LINEARS = {"targets": ["Linear"], "format": "float-quantized", "weights": {
    "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}
_CT_INT4_EXPERTS = {"targets": ["re:.*experts.*"], "format": "pack-quantized", "weights": {
    "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True, "dynamic": False}}
EXPERTS_APART = {
    "fp8, experts left out": ("qwen3-30b-a3b", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                "modules_to_not_convert": [".*experts"]}, "bf16"),
    "gptq, experts '-:'": ("qwen3-30b-a3b", {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                             "dynamic": {"-:.*experts.*": {}}}, "bf16"),
    "modelopt, experts excluded": ("mixtral-8x7b", {"quant_method": "modelopt", "quant_algo": "FP8",
                                                    "exclude_modules": ["*block_sparse_moe.experts*"]}, "bf16"),
    "compressed-tensors, int4 experts beside fp8": ("qwen3-30b-a3b", {
        "quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*mlp.gate$"], "config_groups": {"linears": _CT_FP8_LINEARS,
                                                                   "experts": _CT_INT4_EXPERTS}}, "int4"),
}


@pytest.mark.parametrize("case", list(EXPERTS_APART))
def test_experts_stored_apart_are_planned_as_held(case):
    """A checkpoint leaving its routed experts in 16 bits, or storing them in a scheme of their own,
    is planned at the bytes the engine holds (built on the meta device, two layers of the real shape),
    not at its linears' dtype: planning the experts at the linears' would plan too little memory."""
    from shardserve.planner.catalog import checkpoint_expert_bytes
    from shardserve.planner.memory import WEIGHT_BYTES, config_dtype
    from shardserve.planner.plan import model_shape
    name, quantization, experts_held = EXPERTS_APART[case]
    config = {**shape_config(name), "num_hidden_layers": 2, "quantization_config": quantization}
    dtype = config_dtype(config)
    assert checkpoint_expert_bytes(config, dtype) == WEIGHT_BYTES[experts_held]
    built = held_bytes(build_model(config, torch.bfloat16, torch.device("meta")))
    planned = model_shape(config, {}, dtype).weight_bytes(dtype, 1, range(2), True, True)
    unaware = ModelShape(config).weight_bytes(dtype, 1, range(2), True, True)
    # within 3%: INT4 experts hold fp32 scales until the GPU repacks them (the planner counts the
    # repacked layout), and the rotary table counts more in two layers
    assert abs(built / planned - 1) < 0.03, f"{case}: built {built / 2**30:.3f} GiB, plan {planned / 2**30:.3f}"
    assert abs(built / unaware - 1) > 0.1   # the case matters: ignoring where the experts sit is off by >10%


def test_experts_apart_in_some_layers_are_planned_layer_by_layer():
    """An FP8 checkpoint leaving only the first layer's experts in 16 bits: the experts are planned
    at the mean of their layers' bytes, as the built model holds them."""
    from shardserve.planner.catalog import checkpoint_expert_bytes
    from shardserve.planner.memory import WEIGHT_BYTES, config_dtype
    from shardserve.planner.plan import model_shape
    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic",
                    "modules_to_not_convert": ["model.layers.0.mlp.experts"]}
    config = {**shape_config("qwen3-30b-a3b"), "num_hidden_layers": 2, "quantization_config": quantization}
    dtype = config_dtype(config)
    assert checkpoint_expert_bytes(config, dtype) == (WEIGHT_BYTES["bf16"] + WEIGHT_BYTES["fp8"]) / 2
    built = held_bytes(build_model(config, torch.bfloat16, torch.device("meta")))
    planned = model_shape(config, {}, dtype).weight_bytes(dtype, 1, range(2), True, True)
    assert abs(built / planned - 1) < 0.03, f"built {built / 2**30:.3f} GiB, plan {planned / 2**30:.3f}"
