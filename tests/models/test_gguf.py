"""GGUF checkpoints end to end: logits against HF on the same weights, dtype, tokenizer and chat
template from the metadata, clear errors, and Llama-3.1 rope_freqs."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams
from tests.models.gguf_files import (
    VOCAB,
    gguf_vocab,
    hf_logprobs,
    hf_with_roundtripped_weights,
    prompt_logprobs,
    random_prompt,
    write_gguf,
)
from tests.tiny_models import EOS_ID, assert_serves_bf16_values, load_hf_model, make_tiny_checkpoint


@pytest.mark.parametrize("arch,qtype,loose_tol", [("llama", "F32", 1e-4), ("smollm2", "F16", 0.02),
                                                  ("llama", "Q8_0", 0.25)])
def test_gguf_logits_match_hf(tmp_path, monkeypatch, arch, qtype, loose_tol):
    """llama: GQA 4/2 heads, separate lm_head; smollm2: GQA 6/2 heads, tied embeddings. Q8_0 stays in
    its blocks (the default), multiplied here with fp32 activations, the exact path; the default
    int8 dot products are checked in tests/quantization/test_gguf_quant.py."""
    monkeypatch.setenv("SHARDSERVE_GGUF_ACTIVATIONS", "fp32")
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
    assert_serves_bf16_values(llm)

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
