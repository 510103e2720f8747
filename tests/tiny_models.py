"""Tiny random-weight HF checkpoints built from real configs, for fast CPU tests.

`make_tiny_checkpoint(dir, arch)` writes config.json, sharded safetensors with an index, a
byte-level BPE tokenizer.json (256 byte tokens + ChatML specials) and a chat template, exactly the
files a real HF checkpoint directory has.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 256 + SPECIALS.index("<|im_end|>")

# A small shape per architecture, with the switches that make each one different.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=10000.0),
    "llama3": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32),
    "smollm2": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True,
                    num_attention_heads=6, num_key_value_heads=2, rope_theta=100000.0),
    # Mixtures of experts: 8 experts, more than top-k picks per token, so routing matters.
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=32, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=64, sliding_window=None),
    "olmoe": dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], num_experts=8, num_experts_per_tok=3,
                  intermediate_size=64, norm_topk_prob=False, clip_qkv=3.0),
}


def tiny_hf_config(arch: str, **overrides: Any):
    from transformers import AutoConfig
    base = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=320, max_position_embeddings=1024, rms_norm_eps=1e-6,
                initializer_range=0.08, tie_word_embeddings=False, bos_token_id=256 + SPECIALS.index("<|im_start|>"),
                eos_token_id=EOS_ID)
    base.update(TINY_CONFIGS[arch])
    base.update(overrides)
    model_type = base.pop("model_type")
    return AutoConfig.for_model(model_type, **base)


def write_tokenizer(path: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = ByteLevel.alphabet()
    byte_order = sorted(alphabet)   # deterministic ids 0..255 for the 256 byte symbols
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_order)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}, f)


def make_tiny_checkpoint(path: str, arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
                         **overrides: Any) -> str:
    """Write a random-weight checkpoint directory and return its path."""
    from transformers import AutoModelForCausalLM
    os.makedirs(path, exist_ok=True)
    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB")
    write_tokenizer(path)
    return path


def load_hf_model(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def assert_serves_bf16_values(llm) -> None:
    """A bf16 model holds bf16 values, never more precision than the checkpoint has. On CPUs without
    bf16 matrix units it computes in fp32: the native kernels keep the matrices and the KV cache in
    bf16 and widen them in registers; without those kernels everything is held in fp32."""
    from shardserve.kernels.cpu import cpu_ops
    mc = llm.engine.config.model_config
    runner = llm.engine.executor.worker.model_runner
    native = mc.compute_dtype == torch.float32 and cpu_ops.available()
    assert {c.dtype for c in runner.kv_caches} == {torch.bfloat16 if native else mc.compute_dtype}
    for p in runner.model.parameters():
        assert p.dtype == (torch.bfloat16 if native and p.dim() >= 2 else mc.compute_dtype)
        assert torch.equal(p.to(torch.bfloat16).to(p.dtype), p)
