"""Shared GPU fixtures: a random-weight checkpoint with Llama-3-8B's exact shapes (16 GB bf16)."""
from __future__ import annotations

import pytest
import torch

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                 architectures=["LlamaForCausalLM"])


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    path = str(tmp_path_factory.mktemp("llama3_8b_random"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA3_8B)).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="4GB")
    del model
    torch.cuda.empty_cache()
    return path


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1000, 120000, (n,), generator=g).tolist() for n in (17, 100, 333)]


