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

# The catalog entries the engine can build (models/llama.py: the dense Llama and Qwen3 families).
SHAPES: dict[str, dict[str, Any]] = {name: cfg for name, cfg in MODELS.items()
                                     if cfg["model_type"] in ("llama", "qwen3")}


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
    """Parameters per layer, of all layers, embeddings, LM head and in total (planner/memory.py)."""
    return ModelShape(config).param_counts()
