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
