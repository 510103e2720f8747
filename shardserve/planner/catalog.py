"""Built-in model catalog: the published HF config.json values of well-known models, the single
source of model shapes in shardserve (`bench --random-weights` builds its shapes from here too).

Only the fields that size a model are kept exactly as published (widths, layers, heads, experts,
vocabulary, context, dtype, quantization); a planner needs nothing else."""
from __future__ import annotations

import json
import os
import re
from typing import Any

_LLAMA31 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, rope_theta=500000.0,
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, rope_theta=1000000.0,
              max_position_embeddings=40960, rms_norm_eps=1e-6, head_dim=128, hidden_act="silu",
              attention_bias=False, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
_QWEN3_MOE = dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=128,
                  num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                  tie_word_embeddings=False)

MODELS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(_LLAMA31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8),
    "llama-3.1-70b": dict(_LLAMA31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8),
    "llama-3.1-405b": dict(_LLAMA31, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                           num_attention_heads=128, num_key_value_heads=8),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-14b": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000,
                         hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
                         sliding_window=None, tie_word_embeddings=False, hidden_act="silu", bos_token_id=1,
                         eos_token_id=2, torch_dtype="bfloat16"),
    # DeepSeek-V3 (671B total, 37B active). Multi-head latent attention (MLA): q and kv go through
    # low-rank projections (q_lora_rank, kv_lora_rank) and the KV cache stores the compressed latent
    # (kv_lora_rank) plus the shared rotary key (qk_rope_head_dim) per token and layer, not per-head
    # K and V. The published weights are FP8 with 128x128 block scales (quantization_config). The
    # one multi-token-prediction layer (num_nextn_predict_layers, ~14B of the hub's 685B) is not
    # used for plain decoding and is not counted.
    "deepseek-v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
                        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_hidden_layers=61, num_nextn_predict_layers=1, num_attention_heads=128,
                        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                        num_experts_per_tok=8, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                        first_k_dense_replace=3, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6,
                        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
                        tie_word_embeddings=False, hidden_act="silu", bos_token_id=0, eos_token_id=1,
                        torch_dtype="bfloat16",
                        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}),
}
# Llama 3 (April 2024) has the Llama 3.1 shapes with an 8K context and no rope scaling.
for _size in ("8b", "70b"):
    _cfg = {k: v for k, v in MODELS[f"llama-3.1-{_size}"].items() if k != "rope_scaling"}
    MODELS[f"llama-3-{_size}"] = dict(_cfg, max_position_embeddings=8192)

_SUFFIXES = re.compile(r"-(instruct|chat|base|hf|v0\.1|fp8|bf16)$")


def catalog_key(name: str) -> str | None:
    """'meta-llama/Llama-3.1-70B-Instruct', 'Qwen/Qwen3-8B', 'DeepSeek-V3' -> a catalog key (or None)."""
    key = name.strip().lower().rsplit("/", 1)[-1].removeprefix("meta-")
    while True:
        stripped = _SUFFIXES.sub("", key)
        if stripped == key:
            break
        key = stripped
    return key if key in MODELS else None


def model_config(name: str) -> dict[str, Any]:
    key = catalog_key(name)
    if key is None:
        raise ValueError(f"unknown model {name!r}; built in: {', '.join(MODELS)}")
    return json.loads(json.dumps(MODELS[key]))   # a deep copy: callers may edit theirs


_GGUF_LINEAR = re.compile(r"blk\.\d+\.(attn_(q|k|v|qkv|output)|ffn_(gate|up|down)(_shexp)?)\.weight")
_GGUF_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def gguf_linear_bytes(facts: dict[str, Any], dtype: str) -> float | None:
    """Bytes per weight a GPU holds for a GGUF file's decoder linears served in `dtype` (bf16, fp16,
    fp32): the 4-bit types CUDA keeps in their blocks (quantization/gguf.py `gpu_keeps`, so
    SHARDSERVE_GGUF_DEQUANTIZE=1 counts none) at their layout's size (kernels/quant/gguf_layout.py),
    the rest at `dtype` (with =0 the other types' planes are smaller: an upper bound). None for other
    sources."""
    from shardserve.planner.memory import WEIGHT_BYTES
    counts = facts.get("linear_elements_by_type") or {}
    if facts.get("source") != "gguf" or not counts or dtype not in ("bf16", "fp16", "fp32"):
        return None
    held = sum(n * (_gpu_bits(t, dtype) or WEIGHT_BYTES[dtype]) for t, n in counts.items())
    return held / sum(counts.values())


def gguf_expert_bytes(facts: dict[str, Any], dtype: str) -> float | None:
    """Bytes per weight a GPU holds for a GGUF MoE file's routed experts served in `dtype`: a layer
    whose gate, up and down are 4-bit types CUDA keeps (gate and up of one type; bf16 / fp16 models)
    holds them in the INT4 experts' layout (quantization/gguf_moe.py), as many bits a weight as the
    linears' layout; other layers dequantize their experts to `dtype`. None for other sources."""
    from shardserve.planner.memory import WEIGHT_BYTES
    layers = facts.get("expert_elements_by_types") or {}
    if facts.get("source") != "gguf" or not layers or dtype not in ("bf16", "fp16", "fp32"):
        return None
    held = 0.0
    for types, n in layers.items():
        gate, up, down = types.split(",")
        bits = [_gpu_bits(t, dtype) for t in (gate, up, down)]
        kept = dtype != "fp32" and gate == up and None not in bits
        # gate, up and down hold the same number of weights each
        held += n * (sum(bits) / 3 if kept else WEIGHT_BYTES[dtype])
    return held / sum(layers.values())


def checkpoint_expert_bytes(config: dict[str, Any], dtype: str) -> float | None:
    """Bytes per weight a GPU holds for a quantized checkpoint's routed experts where they are stored
    otherwise than `dtype` says of its linears: left in 16 bits (an ignore list, "-:" override or
    exclusion naming them), or in a config group of their own. The engine's own rules decide
    (the format's `scheme_for` / `ignores` on the checkpoint's expert names, as models/loader.
    place_schemes asks them), layer by layer (the mean over the MoE layers: a checkpoint may leave
    some layers' experts in 16 bits); then how a GPU holds experts of that scheme:
    FP8 and 4-bit ones as stored, INT8 ones widened (quantization/int8.Int8MoEMethod) and FP4 ones
    dequantized (quantization/fp4_moe.py) to 16 bits. None: as the linears, or nothing to ask (no
    quantization, a model the engine does not serve, `dtype` not the checkpoint's)."""
    from shardserve.planner.memory import WEIGHT_BYTES, ModelShape, config_dtype
    from shardserve.quantization.stored import weight_dtype
    q, shape = config.get("quantization_config"), ModelShape(config)
    if not q or dtype != config_dtype(config) or not any(shape.moe_layers):
        return None
    from shardserve.models.registry import resolve_model_class
    from shardserve.quantization.config import resolve_quantization
    try:
        names = resolve_model_class(config).expert_checkpoint_names
        quant = resolve_quantization(None, config)
    except (ValueError, AttributeError):   # a model or format the engine refuses, or one without experts
        return None

    def held(name: str) -> str:
        if quant is None:   # e.g. a pruned compressed-tensors checkpoint stored dense
            return "bf16"
        if hasattr(quant, "scheme_for"):
            scheme = quant.scheme_for(name)
        else:
            scheme = None if getattr(quant, "ignores", lambda _: False)(name) else weight_dtype(q)
        if scheme is None:
            return "bf16"
        if isinstance(scheme, tuple):   # GPTQ's (bits, group_size, desc_act): 8-bit experts are refused
            return "int4" if scheme[0] == 4 else "bf16"
        kind = str(getattr(scheme, "weights", scheme)).lower()   # compressed-tensors' CtScheme, ModelOpt's algo
        return kind if kind in ("fp8", "int4") else "bf16"
    per_layer = []   # each MoE layer's experts (one scheme a layer: the engine refuses several; the widest)
    for layer in (i for i, moe in enumerate(shape.moe_layers) if moe):
        stored = {held(n) for e in range(shape.experts) for n in names(f"model.layers.{layer}.mlp.experts", e)}
        per_layer.append(max(WEIGHT_BYTES[d] for d in stored))
    mean = sum(per_layer) / len(per_layer)   # the layers' experts are the same size
    return None if mean == WEIGHT_BYTES[dtype] else mean


def gguf_embedding_bytes(facts: dict[str, Any], dtype: str) -> float | None:
    """Bytes per weight a GPU holds for a GGUF file's token embedding: an untied table of a type the
    GPU keeps stays in its blocks (layers/vocab.py); None where it is dequantized to `dtype`."""
    kind = facts.get("embedding_type")
    if facts.get("source") != "gguf" or facts.get("tied") or kind is None:
        return None
    return _gpu_bits(kind, dtype)


def _gpu_bits(type_name: str, dtype: str) -> float | None:
    """Bytes per weight of a 4-bit GGUF type a GPU keeps in the W4A16 layout, else None."""
    from shardserve.kernels.quant import gguf_layout
    from shardserve.quantization.gguf import gpu_keeps
    if type_name not in gguf_layout.INT4_TYPES or not gpu_keeps(type_name):
        return None
    return gguf_layout.gpu_bits(type_name, exact=dtype == "fp32") / 8


def resolve_model(spec: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """MODEL as the user gave it -> (display name, HF config, facts about the source).

    A catalog name, an HF config.json, a checkpoint directory or a GGUF file (metadata only: the
    tensors' shapes are read from the header, their data is never touched)."""
    from shardserve.models import loader
    key = catalog_key(spec)
    if key is not None and not os.path.exists(spec):
        return key, model_config(spec), {"source": "catalog"}
    if not os.path.exists(spec):
        raise ValueError(f"model {spec!r} is neither a file, a directory nor a built-in name; "
                         f"built in: {', '.join(MODELS)}")
    if os.path.isfile(spec) and spec.endswith(".json"):
        with open(spec, encoding="utf-8") as f:
            try:
                return (os.path.basename(os.path.dirname(os.path.abspath(spec))), json.load(f),
                        {"source": "config.json", "path": os.path.dirname(spec) or "."})
            except json.JSONDecodeError as e:
                raise ValueError(f"{spec} is not valid JSON: {e}") from e
    config = loader.load_hf_config(spec)
    name = os.path.basename(os.path.normpath(spec))
    if loader.is_gguf(spec):
        from shardserve.models.gguf_loader import open_gguf
        reader = open_gguf(spec)
        kinds = sorted({t.tensor_type.name for t in reader.tensors})
        linears: dict[str, int] = {}   # the decoder's linear weights (not MoE experts) by GGUF type
        experts: dict[int, dict[str, tuple[str, int]]] = {}   # layer -> gate / up / down -> (type, weights)
        for t in reader.tensors:
            if _GGUF_LINEAR.fullmatch(t.name):
                linears[t.tensor_type.name] = linears.get(t.tensor_type.name, 0) + int(t.n_elements)
            elif (m := _GGUF_EXPERTS.fullmatch(t.name)):
                experts.setdefault(int(m[1]), {})[m[2]] = (t.tensor_type.name, int(t.n_elements))
        by_types: dict[str, int] = {}   # "gate,up,down" GGUF types -> the routed experts' weights
        for parts in experts.values():
            if len(parts) == 3:
                key = ",".join(parts[p][0] for p in ("gate", "up", "down"))
                by_types[key] = by_types.get(key, 0) + sum(n for _, n in parts.values())
        table = {t.name: t.tensor_type.name for t in reader.tensors if t.name in ("token_embd.weight", "output.weight")}
        return name, config, {"source": "gguf", "path": spec, "file_bytes": os.path.getsize(spec),
                              "params": int(sum(int(t.n_elements) for t in reader.tensors)), "tensor_types": kinds,
                              "linear_elements_by_type": linears, "expert_elements_by_types": by_types,
                              "embedding_type": table.get("token_embd.weight"), "tied": "output.weight" not in table}
    return name, config, {"source": "checkpoint", "path": spec}
