"""Checkpoint loading: the errors a user can hit, GGUF files written the way llama.cpp writes them
(q/k row permutation, F32 / F16 / Q8_0 tensors, a byte-level BPE tokenizer in the metadata), and
dequantization of the block formats we claim to support."""
from __future__ import annotations

import glob
import json
import os
import random
import re

import numpy as np
import pytest
import torch

from shardserve.llm import LLM
from shardserve.models import gguf_loader
from shardserve.sampling_params import SamplingParams
from tests.tiny_models import CHATML, EOS_ID, SPECIALS, load_hf_model, make_tiny_checkpoint

VOCAB = 320


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A pristine tiny llama checkpoint; tests that break a checkpoint work on a copy."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt")), "llama")


@pytest.fixture
def broken_ckpt(ckpt, tmp_path) -> str:
    import shutil
    dst = str(tmp_path / "broken")
    shutil.copytree(ckpt, dst)
    return dst


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


# ---- errors ------------------------------------------------------------------------------------

def test_prompt_longer_than_max_model_len(ckpt):
    llm = LLM(ckpt, max_model_len=64, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    with pytest.raises(ValueError) as e:
        llm.generate([random_prompt(0, 65)], SamplingParams(max_tokens=1))
    assert "65" in str(e.value) and "64" in str(e.value)
    assert not llm.engine.has_unfinished_requests()
    # The limit itself is fine.
    out = llm.generate([random_prompt(0, 63)], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_unsupported_architecture(broken_ckpt):
    config_file = os.path.join(broken_ckpt, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = ["GPT2LMHeadModel"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError) as e:
        LLM(broken_ckpt, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_missing_weight_shard(broken_ckpt):
    with open(os.path.join(broken_ckpt, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[1]
    os.remove(os.path.join(broken_ckpt, shard))
    with pytest.raises((FileNotFoundError, ValueError)) as e:
        LLM(broken_ckpt, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    assert shard in str(e.value)


@pytest.mark.parametrize("keep", [0.5, 0.002], ids=["truncated-data", "truncated-header"])
def test_corrupt_safetensors(broken_ckpt, keep):
    shard = sorted(glob.glob(os.path.join(broken_ckpt, "*.safetensors")))[2]
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(max(1, int(size * keep)))
    with pytest.raises(ValueError) as e:
        LLM(broken_ckpt, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    assert os.path.basename(shard) in str(e.value)


def test_kv_budget_too_small_says_how_much_is_needed(ckpt):
    with pytest.raises(ValueError) as e:
        LLM(ckpt, kv_cache_memory="64KiB", show_progress=False, max_logprobs=-1)
    msg = str(e.value)
    assert "1024" in msg   # the max_model_len that does not fit
    m = re.search(r"\((\d+) bytes\)", msg)
    assert m, f"the error should state the bytes needed: {msg}"
    need = int(m.group(1))
    # 2 (K, V) x 2 layers x 16 tokens x 2 kv heads x 24 dims x 4 bytes per block; 64 blocks + the null one.
    per_block = 2 * 2 * 16 * 2 * 24 * 4
    assert 64 * per_block <= need <= 65 * per_block
    # ... and that much is indeed enough.
    llm = LLM(ckpt, kv_cache_memory=need, show_progress=False, max_logprobs=-1)
    out = llm.generate([random_prompt(1, 1000)], SamplingParams(temperature=0, max_tokens=24))[0]
    assert len(out.outputs[0].token_ids) == 24


def test_max_model_len_above_max_position_embeddings(ckpt):
    with pytest.raises(ValueError) as e:
        LLM(ckpt, max_model_len=4096, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    assert "4096" in str(e.value) and "1024" in str(e.value) and "max_position_embeddings" in str(e.value)


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        LLM(str(tmp_path / "nope"), show_progress=False, max_logprobs=-1)


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


def roundtrip(w: np.ndarray, qtype_name: str) -> np.ndarray:
    """What a reader gets back for a weight stored as qtype_name (2-D weights only; norms stay F32)."""
    import gguf
    if qtype_name == "F32" or w.ndim == 1:
        return w
    if qtype_name == "F16":
        return w.astype(np.float16).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def write_gguf(ckpt_dir: str, out_path: str, qtype_name: str, rope_freqs: np.ndarray | None = None) -> None:
    """Convert a tiny HF llama checkpoint the way convert_hf_to_gguf.py does (Llama 3.1 rope
    scaling goes into a rope_freqs tensor of per-frequency divisors, as llama.cpp stores it)."""
    import gguf
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        cfg = json.load(f)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(out_path, "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
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
        if data.ndim == 1 or qtype_name == "F32":
            w.add_tensor(gname, data.astype(np.float32))
        elif qtype_name == "F16":
            w.add_tensor(gname, data.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[qtype_name]
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)


def hf_with_roundtripped_weights(ckpt_dir: str, qtype_name: str):
    """The HF model with each weight replaced by what the GGUF file stores for it."""
    hf = load_hf_model(ckpt_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.from_numpy(roundtrip(p.detach().numpy().copy(), qtype_name)))
    return hf


def prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=-1))[0]
    return torch.tensor([[row[t].logprob for t in range(VOCAB)] for row in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("arch,qtype,loose_tol", [("llama", "F32", 1e-4), ("smollm2", "F16", 0.02),
                                                  ("llama", "Q8_0", 0.25)])
def test_gguf_logits_match_hf(tmp_path, arch, qtype, loose_tol):
    """llama: GQA 4/2 heads, separate lm_head; smollm2: GQA 6/2 heads, tied embeddings."""
    ckpt_dir = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch)
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    write_gguf(ckpt_dir, path, qtype)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    hf_config = llm.engine.config.model_config.hf_config
    assert hf_config["tie_word_embeddings"] == (arch == "smollm2")
    assert hf_config["num_key_value_heads"] < hf_config["num_attention_heads"]
    prompt = random_prompt(5, 40)
    ours = prompt_logprobs(llm, prompt)
    # Against HF on exactly the weights the file holds: tight, whatever the storage type.
    exact = hf_logprobs(hf_with_roundtripped_weights(ckpt_dir, qtype), prompt)[:len(prompt) - 1]
    diff = (ours - exact).abs().max().item()
    assert diff <= 1e-4, f"{qtype}: log-probs differ from HF on the same weights by {diff:.2e}"
    # Against the original full-precision model: within the storage type's error.
    orig = hf_logprobs(load_hf_model(ckpt_dir), prompt)[:len(prompt) - 1]
    diff = (ours - orig).abs().max().item()
    assert diff <= loose_tol, f"{qtype}: log-probs are {diff:.3f} away from the original model"
    if qtype != "F32":
        assert diff > 1e-6, "a quantized file should not reproduce the original exactly"
    # Greedy decoding runs end to end on the GGUF model.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6


def test_gguf_dtype_auto_is_bf16_and_transformers_agrees(tmp_path):
    """A GGUF file serves in bf16 by default. And transformers' own GGUF loader (which undoes the
    q/k permutation itself) reads our test file back to the original model: the file is faithful."""
    ckpt_dir = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    path = str(tmp_path / "tiny-F32.gguf")
    write_gguf(ckpt_dir, path, "F32")
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    mc = llm.engine.config.model_config
    assert mc.dtype == torch.bfloat16
    # bf16 values, held in the compute dtype (fp32 on CPUs without bf16 matrix units), KV likewise.
    assert {c.dtype for c in llm.engine.executor.worker.model_runner.kv_caches} == {mc.compute_dtype}
    for p in llm.engine.executor.worker.model_runner.model.parameters():
        assert p.dtype == mc.compute_dtype
        assert torch.equal(p.to(torch.bfloat16).to(p.dtype), p)

    from transformers import AutoModelForCausalLM
    hf_gguf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny-F32.gguf",
                                                   dtype=torch.float32).eval()
    prompt = random_prompt(6, 24)
    diff = (hf_logprobs(hf_gguf, prompt) - hf_logprobs(load_hf_model(ckpt_dir), prompt)).abs().max().item()
    assert diff <= 1e-5


def test_gguf_tokenizer_and_chat_template(tmp_path):
    ckpt_dir = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    path = str(tmp_path / "tiny.gguf")
    write_gguf(ckpt_dir, path, "F32")
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    tok = llm.get_tokenizer()
    tokens, _ = gguf_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    assert tok.vocab_size == VOCAB
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == ids["<|im_start|>"]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == EOS_ID
    assert EOS_ID in tok.eos_token_ids
    # Byte-level BPE with the merges: "the" -> t + he; " the" -> Ġthe; specials are single tokens.
    assert tok.encode("the the<|im_end|>") == [ids["t"], ids["he"], ids["Ġthe"], EOS_ID]
    assert tok.encode("a\nb") == [ids["a"], ids["Ċ"], ids["b"]]
    for text in ["the cat sat", "héllo wörld ✓", "x<|im_start|>y"]:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode("x<|im_start|>y")) == "xy"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.prompt_token_ids == tok.encode(prompt, add_special_tokens=False)
    assert out.prompt_token_ids[0] == ids["<|im_start|>"] and out.prompt_token_ids.count(EOS_ID) == 1


def test_gguf_unsupported_architecture(tmp_path):
    import gguf
    path = str(tmp_path / "gpt2.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as e:
        LLM(path, show_progress=False, max_logprobs=-1)
    assert "gpt2" in str(e.value) and "llama" in str(e.value) and "qwen2" in str(e.value)


def test_gguf_truncated_file(tmp_path):
    ckpt_dir = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    path = str(tmp_path / "cut.gguf")
    write_gguf(ckpt_dir, path, "F32")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError) as e:
        LLM(path, dtype="float32", kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    assert "cut.gguf" in str(e.value)


# ---- dequantization -----------------------------------------------------------------------------

QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """A plain (not error-optimised) Q4_K encoder following ggml's block_q4_K layout:
    d (f16), dmin (f16), 12 bytes of packed 6-bit scales/mins for 8 sub-blocks of 32, 128 bytes
    of 4-bit quants; x_i = d * sc_j * q_i - dmin * m_j."""
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(blocks.min(-1), 0.0)
    scale_f = (blocks.max(-1) - lo) / 15.0
    min_f = -lo
    d = (scale_f.max(-1) / 63.0).astype(np.float16)
    dmin = (min_f.max(-1) / 63.0).astype(np.float16)
    d_f, dmin_f = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(scale_f / np.where(d_f > 0, d_f, 1)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(min_f / np.where(dmin_f > 0, dmin_f, 1)), 0, 63).astype(np.uint8)
    eff_scale = (d_f * sc)[..., None]
    eff_min = (dmin_f * m)[..., None]
    q = np.clip(np.round((blocks + eff_min) / np.where(eff_scale > 0, eff_scale, 1)), 0, 15).astype(np.uint8)
    scales = np.zeros((len(blocks), 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(len(blocks), 128)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    return out.reshape(x.shape[0], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """A plain Q6_K encoder following ggml's block_q6_K layout: ql (128 bytes, low 4 bits),
    qh (64 bytes, high 2 bits), 16 int8 scales for sub-blocks of 16, d (f16);
    x_i = d * sc_j * (q_i - 32)."""
    blocks = x.reshape(-1, 16, 16).astype(np.float32)
    scale_f = np.abs(blocks).max(-1) / 31.0
    d = (scale_f.max(-1) / 127.0).astype(np.float16)
    d_f = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale_f / np.where(d_f > 0, d_f, 1)), 1, 127).astype(np.int8)
    eff = (d_f * sc)[..., None]
    q = (np.clip(np.round(blocks / np.where(eff > 0, eff, 1)), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    ql = np.zeros((len(q), 128), dtype=np.uint8)
    qh = np.zeros((len(q), 64), dtype=np.uint8)
    for half in range(2):
        v = q[:, 128 * half:128 * (half + 1)]
        a, b, c, e = v[:, 0:32], v[:, 32:64], v[:, 64:96], v[:, 96:128]
        ql[:, 64 * half:64 * half + 32] = (a & 0xF) | ((c & 0xF) << 4)
        ql[:, 64 * half + 32:64 * half + 64] = (b & 0xF) | ((e & 0xF) << 4)
        qh[:, 32 * half:32 * half + 32] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)
    return out.reshape(x.shape[0], -1)


# Relative RMS error bound (vs the tensor's std) for each storage type.
QUANT_RMS = {"F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q5_0": 0.06, "Q5_1": 0.06,
             "Q4_0": 0.12, "Q4_1": 0.12, "Q4_K": 0.12, "Q6_K": 0.03}
CUSTOM_ENCODERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory):
    """One GGUF file holding a random 2-D tensor (3 rows x 512, non-square) per type."""
    import gguf
    rng = np.random.default_rng(0)
    originals = {}
    path = str(tmp_path_factory.mktemp("quant") / "quant.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for name in QUANT_RMS:
        x = (rng.standard_normal((3, 512)) * rng.uniform(0.01, 2.0, size=(3, 1))).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[name]
        if name == "F32":
            w.add_tensor(name, x)
        elif name == "F16":
            w.add_tensor(name, x.astype(np.float16))
        elif name in CUSTOM_ENCODERS:
            w.add_tensor(name, CUSTOM_ENCODERS[name](x), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        originals[name] = x
    # A 1-D tensor and a random-bytes Q5_K tensor (no encoder: checked against gguf's decoder).
    w.add_tensor("norm", originals["F32"][0].copy())
    raw = rng.integers(0, 256, size=(2, 2 * 176), dtype=np.uint8)
    for blk in range(4):   # finite f16 super-block scales (d, dmin) at the head of each block
        row, col = divmod(blk * 176, 2 * 176)
        raw[row, col:col + 4] = _f16_bytes(np.array([0.01, 0.02]))[:, :].reshape(-1)
    w.add_tensor("Q5_K", raw, raw_dtype=gguf.GGMLQuantizationType.Q5_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    return {t.name: t for t in reader.tensors}, originals, raw


@pytest.mark.parametrize("name", list(QUANT_RMS))
def test_dequantize(quant_file, name):
    import gguf
    tensors, originals, _ = quant_file
    t, x = tensors[name], originals[name]
    assert t.tensor_type.name == name
    ours = gguf_loader.dequantize(t)
    assert isinstance(ours, torch.Tensor) and tuple(ours.shape) == x.shape
    ours = ours.float().numpy()
    if name not in ("F32", "F16", "BF16"):
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(x.shape)
        np.testing.assert_array_equal(ours, ref)
    rel_rms = np.sqrt(np.mean((ours - x) ** 2, axis=1)) / x.std(axis=1)   # per row: scales differ
    assert (rel_rms <= QUANT_RMS[name]).all(), f"{name}: relative RMS error {rel_rms}"
    if name != "F32":
        assert (rel_rms > 0).all()


def test_dequantize_1d_and_q5_k(quant_file):
    import gguf
    tensors, originals, raw = quant_file
    norm = gguf_loader.dequantize(tensors["norm"])
    assert tuple(norm.shape) == (512,)
    np.testing.assert_array_equal(norm.numpy(), originals["F32"][0])
    t = tensors["Q5_K"]
    ours = gguf_loader.dequantize(t)
    assert tuple(ours.shape) == (2, 512)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K).reshape(2, 512)
    np.testing.assert_array_equal(ours.numpy(), ref)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0


def test_dequantize_unsupported_type(tmp_path):
    import gguf
    path = str(tmp_path / "q2k.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((1, 84), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = gguf.GGUFReader(path).tensors[0]
    with pytest.raises(ValueError) as e:
        gguf_loader.dequantize(t)
    assert "Q2_K" in str(e.value) and "blk.0.attn_q.weight" in str(e.value) and "Q4_K" in str(e.value)


def test_gguf_rope_freqs_reproduce_llama3_scaling(tmp_path):
    """A Llama-3.1-style GGUF: the rope_freqs divisors must give HF's llama3-scaled logits."""
    from shardserve.layers.rotary import _inv_freq
    ckpt_dir = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama3")
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    theta = cfg["rope_parameters"]["rope_theta"]
    factors = (_inv_freq(head_dim, theta, None) / _inv_freq(head_dim, theta, cfg["rope_parameters"])).numpy()
    assert factors.max() > 1.5   # the scaling really changes some frequencies
    path = str(tmp_path / "tiny-llama3.gguf")
    write_gguf(ckpt_dir, path, "F32", rope_freqs=factors)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    prompt = random_prompt(7, 90)   # positions beyond original_max_position_embeddings=64
    diff = (prompt_logprobs(llm, prompt) - hf_logprobs(load_hf_model(ckpt_dir), prompt)[:len(prompt) - 1]).abs().max()
    assert diff <= 1e-4
