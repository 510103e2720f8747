"""Built-in model shapes for `--random-weights` benchmarks: the planner's catalog of real configs
(as published on the HF hub; shardserve/planner/catalog.py is their one home), written to a
temporary checkpoint directory that holds only config.json, loaded with load_format=dummy (random
weights, no hub, no tokenizer)."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from shardserve.planner.catalog import MODELS
from shardserve.planner.memory import ModelShape

# The catalog entries the engine can build (models/llama.py and models/moe.py: the Llama and Qwen3
# families, Qwen3-MoE and Mixtral).
SHAPES: dict[str, dict[str, Any]] = {name: cfg for name, cfg in MODELS.items()
                                     if cfg["model_type"] in ("llama", "qwen3", "qwen3_moe", "mixtral")}


def shape_config(name: str) -> dict[str, Any]:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; built in: {', '.join(SHAPES)}")
    return json.loads(json.dumps(SHAPES[name]))


def write_shape_dir(config: dict[str, Any], name: str) -> str:
    path = tempfile.mkdtemp(prefix=f"shardserve-{name}-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def param_counts(config: dict[str, Any]) -> dict[str, int]:
    """Parameters per layer, of all layers, embeddings, LM head and in total (planner/memory.py);
    for MoE models also the routed experts' and those a token uses ("active")."""
    return ModelShape(config).param_counts()


def active_layer_params(counts: dict[str, int]) -> int:
    """The layers' parameters one token goes through: all of them for a dense model; for a MoE
    model the routed experts count only for the top-k a token picks."""
    return counts["active"] - counts["embed"] - counts["lm_head"] - (counts["total"] - counts["layers"]
                                                                      - counts["embed"] - counts["lm_head"])


def picked_expert_fraction(config: dict[str, Any], tokens: int) -> float:
    """The expected share of a layer's routed experts that a step over `tokens` tokens reads when
    each token picks top-k of E uniformly: 1 - (1 - k/E)^tokens (exactly k/E for one token); 1 for
    a dense model."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not experts:
        return 1.0
    return 1.0 - (1.0 - int(config["num_experts_per_tok"]) / experts) ** tokens
