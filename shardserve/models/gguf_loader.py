"""GGUF checkpoints: an HF-style config from the metadata, and weights dequantized one tensor at a
time under their HF names (the `gguf` package reads the file through a memory map).

Mixture-of-experts files (llama.cpp's layout): the router `blk.N.ffn_gate_inp` [experts, hidden] and
all experts stacked in `blk.N.ffn_{gate,up,down}_exps` ([experts, inter, hidden] / [experts, hidden,
inter] in torch order), which become `mlp.gate` and `mlp.experts.{gate,up,down}_proj` (models/moe.py
routes the stacked names). Arch `qwen3moe` is Qwen3-MoE, `olmoe` OLMoE, and `llama` with experts is
Mixtral, as llama.cpp converts it (q/k rows permuted like any llama-arch file). A layer without a
router is dense (Qwen3-MoE's `mlp_only_layers`).

Kept quantized (the default; SHARDSERVE_GGUF_DEQUANTIZE=1 dequantizes at load, quantization/gguf.py
`kept_types` says which types stay): where the decoder's linear weights use such a type, the config
gets `quantization_config: {"quant_method": "gguf"}` and those linears receive their raw blocks
(quantization/gguf.py keeps or dequantizes them per layer), as do the token embedding and LM head
where their type takes the int8-activation kernels (layers/vocab.py), and the stacked MoE experts of a
kept type, as uint8 [experts, rows, blocks, bytes] (quantization/gguf_moe.py). Norms and routers are
dequantized."""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Iterator

import numpy as np
import torch

_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe",
                "MixtralForCausalLM": "mixtral"}   # HF's model_type of each class, as its config.json says
_MOE_ARCHS = {"qwen3moe": True, "olmoe": False, "llama": True}   # arch -> renormalise the top-k weights
_SUPPORTED_QUANTS = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# Decoder linears whose weights stay in their GGUF blocks when the file is kept quantized.
_KEPT_LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
_EXPERTS = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@lru_cache(maxsize=4)
def open_gguf(path: str):
    """Parsing a GGUF header takes seconds for large vocabularies: config, tokenizer and weights
    share one reader (the tensor data itself is a memory map)."""
    import gguf
    try:
        return gguf.GGUFReader(path)
    except Exception as e:   # a truncated or foreign file
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e


def field_value(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_to_hf_config(reader) -> dict[str, Any]:
    arch = field_value(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(_ARCHS))}")

    def meta(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "architectures": [_ARCHS[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(meta("context_length", 4096)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "bfloat16",
        "gguf_architecture": arch,
    }
    # Llama 3.1-style rope scaling is stored by llama.cpp as per-frequency divisors.
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        cfg["rope_freq_factors"] = [float(x) for x in np.asarray(freqs.data, dtype=np.float32).reshape(-1)]
    if _keeps_quantized(reader):
        cfg["quantization_config"] = {"quant_method": "gguf"}
    window = meta("attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    if int(meta("expert_count", 0) or 0) or arch in ("qwen3moe", "olmoe"):
        cfg.update(_moe_config(arch, meta, tensor_names, cfg["num_hidden_layers"]))
    cfg["model_type"] = _MODEL_TYPES[cfg["architectures"][0]]
    return cfg


def _is_kept_linear(gguf_name: str) -> bool:
    m = _BLOCK_RE.match(gguf_name)
    return bool(m) and m.group(2) in _KEPT_LINEARS and m.group(3) == "weight"


def _is_kept_experts(tensor) -> bool:
    """A stacked experts tensor (ffn_{gate,up,down}_exps) of a type kept_types() names."""
    from shardserve.quantization.gguf import kept_types
    m = _BLOCK_RE.match(tensor.name)
    return bool(m) and m.group(2) in _EXPERTS and tensor.tensor_type.name in kept_types()


def _table_keeps(tensor) -> tuple[bool, bool]:
    """For the token embedding or LM head: whether the CPU's int8-activation kernels, and whether the
    GPU, would keep its type in blocks (either: it is handed over as blocks tagged with both, and
    layers/vocab.py decides by device); (False, False) for other tensors.
    SHARDSERVE_GGUF_ACTIVATIONS=fp32 dequantizes them on the CPU as before."""
    from shardserve.quantization.gguf import cpu_keeps_table, gpu_keeps
    if tensor.name not in ("token_embd.weight", "output.weight"):
        return False, False
    kind = tensor.tensor_type.name
    return cpu_keeps_table(kind), gpu_keeps(kind)


def _keeps_quantized(reader) -> bool:
    """Whether the linears stay in their blocks: some use a type kept_types() names (on CUDA the
    layers are expanded once after loading, quantization/gguf.py)."""
    from shardserve.quantization.gguf import kept_types
    kept = kept_types()
    return any(_is_kept_linear(t.name) and t.tensor_type.name in kept for t in reader.tensors)


def raw_blocks(tensor) -> torch.Tensor:
    """A tensor's bytes as uint8 [rows, blocks, block bytes] (a float tensor: blocks of one value),
    tagged with its type as `.gguf_type`."""
    from shardserve.quantization.gguf import block_size
    kind = tensor.tensor_type.name
    unit, nbytes = block_size(kind)
    k, rows = int(tensor.shape[0]), int(np.prod([int(d) for d in tensor.shape[1:]]))
    raw = torch.from_numpy(np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, k // unit, nbytes).copy())
    return raw


def _moe_config(arch: str, meta, tensor_names: set[str], num_layers: int) -> dict[str, Any]:
    """The HF MoE keys (as Qwen3-MoE / Mixtral / OLMoE configs name them) from llama.cpp's metadata."""
    experts, top_k = int(meta("expert_count", 0) or 0), int(meta("expert_used_count", 0) or 0)
    if arch not in _MOE_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} with {experts} experts is not supported; mixture-of-experts "
                         f"architectures: {', '.join(sorted(_MOE_ARCHS))} (llama: Mixtral)")
    if experts <= 0 or not 0 < top_k <= experts:
        raise ValueError(f"GGUF {arch} file has expert_count={experts} and expert_used_count={top_k}: "
                         "a mixture-of-experts model needs 0 < expert_used_count <= expert_count")
    if int(meta("expert_shared_count", 0) or 0) or meta("expert_shared_feed_forward_length"):
        raise ValueError(f"GGUF {arch} file has shared experts, which are not supported")
    gating = meta("expert_gating_func")
    if gating is not None and int(gating) != 1:   # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ValueError(f"GGUF {arch} file routes with expert_gating_func={gating}; only softmax (1) is supported")
    scale = meta("expert_weights_scale")
    if scale is not None and float(scale) != 1.0:
        raise ValueError(f"GGUF {arch} file scales expert weights by {scale}, which is not supported")
    cfg: dict[str, Any] = {
        "num_experts": experts, "num_experts_per_tok": top_k,
        # llama.cpp's graphs renormalise for Qwen3-MoE and Mixtral, not for OLMoE, unless the file says
        "norm_topk_prob": bool(meta("expert_weights_norm", _MOE_ARCHS[arch])),
        "mlp_only_layers": [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
    }
    if meta("expert_feed_forward_length"):
        cfg["moe_intermediate_size"] = int(meta("expert_feed_forward_length"))
    if arch == "llama":
        cfg["architectures"] = ["MixtralForCausalLM"]
    if arch == "olmoe" and meta("attention.clamp_kqv"):   # as llama.cpp stores OLMo's clip_qkv
        cfg["clip_qkv"] = float(meta("attention.clamp_kqv"))
    return cfg


def _reverse_llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the rotary halves of q and k rows; undo it."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None   # e.g. rope_freqs: not a parameter


def dequantize(tensor) -> torch.Tensor:
    import gguf
    kind = tensor.tensor_type.name
    if kind not in _SUPPORTED_QUANTS:
        raise ValueError(f"GGUF tensor {tensor.name} uses {kind}, which is not supported; "
                         f"supported: {', '.join(sorted(_SUPPORTED_QUANTS))}")
    if kind == "BF16":   # numpy has no bfloat16: reinterpret the raw 16-bit words
        raw = np.ascontiguousarray(tensor.data).view(np.int16)
        out = torch.from_numpy(raw.copy()).view(torch.bfloat16)
    elif kind in ("F32", "F16"):
        out = torch.from_numpy(np.array(tensor.data))
    else:
        out = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    shape = [int(d) for d in reversed(tensor.shape)]   # GGUF lists dims innermost first
    return out.reshape(shape)


def iter_gguf_weights(reader, hf_config: dict[str, Any],
                      wanted=lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    permute = hf_config.get("gguf_architecture") == "llama"
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    keep = (hf_config.get("quantization_config") or {}).get("quant_method") == "gguf"
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None or not wanted(name):   # skipped before dequantizing
            continue
        experts = keep and _is_kept_experts(tensor)
        table = _table_keeps(tensor) if keep else (False, False)
        kept = experts or (keep and (_is_kept_linear(tensor.name) or any(table)))
        weight = raw_blocks(tensor) if kept else dequantize(tensor)
        if experts:   # [experts x rows, ...] -> [experts, rows, blocks, bytes]
            weight = weight.view(int(tensor.shape[-1]), -1, *weight.shape[1:])
        # Blocks run along K, so permuting rows works on raw blocks as on values.
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _reverse_llama_permute(weight, heads)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _reverse_llama_permute(weight, kv_heads)
        if kept:
            weight.gguf_type = tensor.tensor_type.name
        if any(table):   # where the table may stay in blocks (layers/vocab.py picks by device)
            weight.gguf_cpu_keeps, weight.gguf_gpu_keeps = table
        yield name, weight


def count_gguf_tensors(reader) -> int:
    return sum(1 for t in reader.tensors if hf_name(t.name) is not None)
