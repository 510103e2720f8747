"""Tiny GGUF files written the way llama.cpp's converter writes them (q/k row permutation, F32 /
F16 / Q8_0 tensors, a byte-level BPE tokenizer and chat template in the metadata), plus the HF and
engine log-prob helpers the GGUF tests compare with."""
from __future__ import annotations

import glob
import json
import os
import random
import re

import numpy as np
import torch

from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams
from tests.tiny_models import CHATML, SPECIALS, load_hf_model

VOCAB = 320


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]

# ---- GGUF files written like llama.cpp's converter ----------------------------------------------

# Byte tokens 0..255 and specials 256..258 as in tests/tiny_models.py, then three merged tokens,
# then [PAD] fillers up to the model's vocabulary size, as llama.cpp pads vocabularies.
MERGES = ["Ġ t", "h e", "Ġt he"]
MERGED = ["Ġt", "he", "Ġthe"]

_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_vocab() -> tuple[list[str], list[int]]:
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel
    tokens = sorted(ByteLevel.alphabet()) + SPECIALS + MERGED
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * 3
    tokens += [f"[PAD{i}]" for i in range(len(tokens), VOCAB)]
    types += [gguf.TokenType.UNUSED] * (VOCAB - len(types))
    return tokens, [int(t) for t in types]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_state_dict(ckpt_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    state: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(ckpt_dir, "*.safetensors"))):
        state.update(load_file(f))
    return state


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit (scale, min) pairs, [..., 8] each -> [..., 12]."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = sc[..., :4] | (sc[..., 4:] >> 4) << 6
    out[..., 4:8] = mn[..., :4] | (mn[..., 4:] >> 4) << 6
    out[..., 8:12] = (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4
    return out


def quantize_k(w: np.ndarray, qtype_name: str) -> np.ndarray:
    """A plain Q4_K / Q5_K / Q6_K quantizer (gguf-py has none): per 32 (Q6_K: 16) values a scale (and
    a min) from the range, 6-bit (Q6_K: 8-bit) scales of a per-256 fp16 d, values rounded to nearest.
    Not llama.cpp's search for the best scales, but the same format. w: [rows, K] -> uint8 [rows, bytes]."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(rows, -1, 256)
    f16 = lambda v: v.astype(np.float16)   # noqa: E731
    if qtype_name == "Q6_K":
        sub = x.reshape(*x.shape[:2], 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = f16(scale.max(-1) / 127)
        df = d.astype(np.float32)[..., None]
        sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.clip(np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)), -32, 31)
        q = q.astype(np.int32) + 32
        q = q.reshape(*x.shape[:2], 2, 128)   # [rows, blocks, h, r]
        ql = np.zeros((*x.shape[:2], 2, 64), dtype=np.uint8)
        ql[:] = (q[..., :64] & 15) | (q[..., 64:] & 15) << 4
        qh = np.zeros((*x.shape[:2], 2, 32), dtype=np.uint8)
        for part in range(4):
            qh |= ((q[..., 32 * part:32 * part + 32] >> 4) << (2 * part)).astype(np.uint8)
        parts = [ql.reshape(*x.shape[:2], 128), qh.reshape(*x.shape[:2], 64), sc.view(np.uint8),
                 d[..., None].view(np.uint8)]
        return np.concatenate(parts, -1).reshape(rows, -1)
    top = 15 if qtype_name == "Q4_K" else 31
    sub = x.reshape(*x.shape[:2], 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - lo) / top, -lo
    d, dmin = f16(scale.max(-1) / 63), f16(mins.max(-1) / 63)
    df, dmf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(mins, dmf, out=np.zeros_like(mins), where=dmf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    shifted = sub + (dmf * mn)[..., None]
    q = np.clip(np.round(np.divide(shifted, step, out=np.zeros_like(sub), where=step > 0)), 0, top).astype(np.uint8)
    qs = (q[:, :, 0::2] & 15) | (q[:, :, 1::2] & 15) << 4   # pair p: sub-blocks 2p (low), 2p + 1 (high)
    parts = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), _k_scale_bytes(sc, mn)]
    if qtype_name == "Q5_K":
        qh = np.zeros((*x.shape[:2], 32), dtype=np.uint8)
        for j in range(8):
            qh |= ((q[:, :, j] >> 4) & 1) << j
        parts.append(qh)
    parts.append(qs.reshape(*x.shape[:2], 128))
    return np.concatenate(parts, -1).reshape(rows, -1)


def quantize(w: np.ndarray, qtype_name: str) -> np.ndarray:
    """gguf-py's quantizer, or quantize_k for the K-quants (blocks along the last axis)."""
    import gguf
    if qtype_name in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize_k(w.reshape(-1, w.shape[-1]), qtype_name).reshape(*w.shape[:-1], -1)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype_name])


def roundtrip(w: np.ndarray, qtype_name: str) -> np.ndarray:
    """What a reader gets back for a weight stored as qtype_name (norms stay F32; blocks run along rows)."""
    import gguf
    if qtype_name == "F32" or w.ndim == 1:
        return w
    if qtype_name == "F16":
        return w.astype(np.float16).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    return gguf.quants.dequantize(quantize(w, qtype_name), qtype).reshape(w.shape)


def _write_metadata(w, cfg: dict, qtype_name: str) -> None:
    """The hyper-parameters, file type and tokenizer every converted file has."""
    import gguf
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    if head_dim != cfg["hidden_size"] // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype_name])
    tokens, types = gguf_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def _add_tensor(w, gname: str, data: np.ndarray, qtype_name: str) -> None:
    """Norms (1-D) and the MoE router stay F32, as llama.cpp's converter keeps them."""
    import gguf
    if data.ndim == 1 or qtype_name == "F32" or gname.endswith("ffn_gate_inp.weight"):
        w.add_tensor(gname, data.astype(np.float32))
    elif qtype_name == "F16":
        w.add_tensor(gname, data.astype(np.float16))
    else:
        w.add_tensor(gname, quantize(data, qtype_name), raw_dtype=gguf.GGMLQuantizationType[qtype_name])


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_random_llama(path: str, shape: dict, tensor_type, blocks, rope_theta: float = 10000.0,
                       max_positions: int = 4096) -> int:
    """A random-weight Llama GGUF with real shapes, for the benchmarks: `shape` has hidden, layers,
    heads, kv_heads, ffn and vocab; tensor_type(gguf name, layer or -1) names each matrix's GGUF
    type; blocks(rows, cols, type) gives its bytes, uint8 [rows, row bytes]; norms are ones.
    Returns the bytes of every matrix but the embedding (what a decode step reads)."""
    import gguf
    global VOCAB
    h, ffn, vocab, kv = shape["hidden"], shape["ffn"], shape["vocab"], shape["kv_heads"] * (shape["hidden"] //
                                                                                           shape["heads"])
    cfg = {"num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"], "hidden_size": h,
           "intermediate_size": ffn, "num_hidden_layers": shape["layers"], "max_position_embeddings": max_positions,
           "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": rope_theta}, "vocab_size": vocab,
           "bos_token_id": 256, "eos_token_id": 257}
    VOCAB = vocab   # the token list padded to this vocabulary
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(os.path.basename(path).removesuffix(".tmp"))
    _write_metadata(w, cfg, "Q8_0")
    tensors = [("token_embd.weight", vocab, h, -1), ("output_norm.weight", h, 0, -1), ("output.weight", vocab, h, -1)]
    for i in range(shape["layers"]):
        tensors += [(f"blk.{i}.{name}", rows, cols, i) for name, rows, cols in (
            ("attn_norm.weight", h, 0), ("attn_q.weight", h, h), ("attn_k.weight", kv, h), ("attn_v.weight", kv, h),
            ("attn_output.weight", h, h), ("ffn_norm.weight", h, 0), ("ffn_gate.weight", ffn, h),
            ("ffn_up.weight", ffn, h), ("ffn_down.weight", h, ffn))]
    read = 0
    for name, rows, cols, layer in tensors:
        if not cols:
            w.add_tensor(name, np.ones(rows, dtype=np.float32))
            continue
        qtype = tensor_type(name, layer)
        raw = blocks(rows, cols, qtype)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
        read += 0 if name == "token_embd.weight" else raw.nbytes
    _finish(w)
    return read


def write_random_qwen3_moe(path: str, config: dict, tensor_type, blocks) -> int:
    """A random-weight Qwen3-MoE GGUF with the shapes of an HF `config` (the planner catalog's
    qwen3-30b-a3b, say), for the benchmarks: tensor_type(gguf name, layer or -1) names each matrix's
    GGUF type, blocks(rows, cols, type) gives its bytes (uint8 [rows, row bytes]); norms are ones and
    the routers random fp32. Returns the bytes a decode step reads of its attention matrices, LM head
    and top-k of the experts (on average, each token's picks)."""
    import gguf
    global VOCAB
    c = config
    h, hd, e, inter, vocab = c["hidden_size"], c["head_dim"], c["num_experts"], c["moe_intermediate_size"], \
        c["vocab_size"]
    cfg = {k: c[k] for k in ("num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
                             "intermediate_size", "num_hidden_layers", "vocab_size", "rms_norm_eps")}
    cfg.update(max_position_embeddings=8192, rope_parameters={"rope_theta": c["rope_theta"]}, bos_token_id=256,
               eos_token_id=257)
    VOCAB = vocab   # the token list padded to this vocabulary
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name(os.path.basename(path))
    _write_metadata(w, cfg, "Q8_0")
    w.add_expert_count(e)
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(inter)
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    tensors = [("token_embd.weight", (vocab, h), -1), ("output.weight", (vocab, h), -1)]
    for i in range(c["num_hidden_layers"]):
        tensors += [(f"blk.{i}.{name}.weight", shape, i) for name, shape in (
            ("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, q)),
            ("ffn_gate_exps", (e, inter, h)), ("ffn_up_exps", (e, inter, h)), ("ffn_down_exps", (e, h, inter)))]
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    rng = np.random.default_rng(0)
    for i in range(c["num_hidden_layers"]):
        for name, n in (("attn_norm", h), ("ffn_norm", h), ("attn_q_norm", hd), ("attn_k_norm", hd)):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(n, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", rng.standard_normal((e, h), dtype=np.float32))
    read = 0
    for name, shape, layer in tensors:
        qtype = tensor_type(name, layer)
        rows = int(np.prod(shape[:-1]))
        raw = blocks(rows, shape[-1], qtype).reshape(*shape[:-1], -1)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
        if name != "token_embd.weight":
            read += raw.nbytes * (c["num_experts_per_tok"] / e if "_exps" in name else 1)
    _finish(w)
    return int(read)


def write_gguf(ckpt_dir: str, out_path: str, qtype_name: str, rope_freqs: np.ndarray | None = None) -> None:
    """Convert a tiny HF llama checkpoint the way convert_hf_to_gguf.py does (Llama 3.1 rope
    scaling goes into a rope_freqs tensor of per-frequency divisors, as llama.cpp stores it)."""
    import gguf
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        cfg = json.load(f)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out_path, "llama")
    w.add_name("tiny-llama")
    _write_metadata(w, cfg, qtype_name)
    for name, tensor in load_state_dict(ckpt_dir).items():
        if name in _GGUF_GLOBAL:
            gname = _GGUF_GLOBAL[name]
        else:
            m = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name)
            assert m, name
            gname = f"blk.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.weight"
        data = tensor.float().numpy()
        if gname.endswith("attn_q.weight"):
            data = llama_cpp_permute(data, heads)
        elif gname.endswith("attn_k.weight"):
            data = llama_cpp_permute(data, kv_heads)
        _add_tensor(w, gname, data, qtype_name)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    _finish(w)


# HF model_type -> llama.cpp's arch (Mixtral converts as llama with experts); HF expert weight names
# (Mixtral's w1/w3/w2) -> llama.cpp's stacked tensors.
MOE_ARCHS = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}
_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_GGUF_MOE_LAYER = {**_GGUF_LAYER, "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
                   "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_moe_gguf(ckpt_dir: str, out_path: str, qtype_name: str) -> None:
    """Convert a tiny Qwen3-MoE / Mixtral / OLMoE checkpoint as convert_hf_to_gguf.py does: each
    layer's per-expert matrices stacked over experts (torch order [experts, rows, cols]), expert
    metadata, q/k rows permuted for the llama arch only. OLMoE's clip_qkv goes in as clamp_kqv (the
    key llama.cpp's converter writes for OLMo)."""
    import gguf
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = MOE_ARCHS[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(f"tiny-{cfg['model_type']}")
    _write_metadata(w, cfg, qtype_name)
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("clip_qkv"):
        w.add_clamp_kqv(cfg["clip_qkv"])
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in load_state_dict(ckpt_dir).items():
        data = tensor.float().numpy()
        m = re.match(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m:
            experts.setdefault(f"blk.{m.group(1)}.{_GGUF_EXPERTS[m.group(3)]}.weight", {})[int(m.group(2))] = data
            continue
        if name in _GGUF_GLOBAL:
            gname = _GGUF_GLOBAL[name]
        else:
            m = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name)
            assert m, name
            gname = f"blk.{m.group(1)}.{_GGUF_MOE_LAYER[m.group(2)]}.weight"
        if arch == "llama" and gname.endswith("attn_q.weight"):
            data = llama_cpp_permute(data, heads)
        elif arch == "llama" and gname.endswith("attn_k.weight"):
            data = llama_cpp_permute(data, kv_heads)
        _add_tensor(w, gname, data, qtype_name)
    for gname, per_expert in experts.items():
        _add_tensor(w, gname, np.stack([per_expert[x] for x in range(len(per_expert))]), qtype_name)
    _finish(w)


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)


def hf_with_roundtripped_weights(ckpt_dir: str, qtype_name: str):
    """The HF model with each weight replaced by what the GGUF file stores for it (a MoE router
    stays F32; stacked experts round per row like the per-expert matrices)."""
    hf = load_hf_model(ckpt_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            qtype = "F32" if name.endswith("mlp.gate.weight") else qtype_name
            p.copy_(torch.from_numpy(roundtrip(p.detach().numpy().copy(), qtype)))
    return hf


def prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=-1))[0]
    return torch.tensor([[row[t].logprob for t in range(VOCAB)] for row in out.prompt_logprobs[1:]])
