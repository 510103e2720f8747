"""Built-in model shapes for `--random-weights` benchmarks: real configs (as published on the HF hub)
written to a temporary checkpoint directory that holds only config.json, loaded with
load_format=dummy (random weights, no hub, no tokenizer)."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, rope_theta=500000.0,
               max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
               bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, rope_theta=1000000.0,
              max_position_embeddings=40960, rms_norm_eps=1e-6, head_dim=128, hidden_act="silu",
              bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8),
    "llama-3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}


def shape_config(name: str) -> dict[str, Any]:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; built in: {', '.join(SHAPES)}")
    return dict(SHAPES[name])


def write_shape_dir(config: dict[str, Any], name: str) -> str:
    path = tempfile.mkdtemp(prefix=f"shardserve-{name}-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def param_counts(config: dict[str, Any]) -> dict[str, int]:
    """Parameters of a dense Llama-family config: per layer, embeddings, LM head."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hd = config.get("head_dim") or h // heads
    attn = h * (heads + 2 * kv) * hd + heads * hd * h
    norms = 2 * h + (2 * hd if config.get("model_type") == "qwen3" else 0)
    per_layer = attn + 3 * h * inter + norms
    embed = config["vocab_size"] * h
    head = 0 if config.get("tie_word_embeddings") else embed
    return {"per_layer": per_layer, "layers": layers * per_layer, "embed": embed, "lm_head": head,
            "total": layers * per_layer + embed + head + h}
