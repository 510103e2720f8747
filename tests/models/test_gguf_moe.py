"""Mixture-of-experts GGUF files (llama.cpp's layout: router `ffn_gate_inp`, experts stacked in
`ffn_{gate,up,down}_exps`): Qwen3-MoE (arch qwen3moe), Mixtral (arch llama with experts, q/k
permuted) and OLMoE (arch olmoe, q/k norms over all heads) against HF on the safetensors checkpoint."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve.llm import LLM
from shardserve.models import gguf_loader
from shardserve.models.spec import LlamaSpec
from shardserve.sampling_params import SamplingParams
from tests.models.gguf_files import (
    hf_logprobs,
    hf_with_roundtripped_weights,
    prompt_logprobs,
    random_prompt,
    write_moe_gguf,
)
from tests.tiny_models import load_hf_model, make_tiny_checkpoint


def _llm(path: str) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,qtype,loose_tol", [("qwen3_moe", "F32", 1e-4), ("mixtral", "F16", 0.02),
                                                  ("olmoe", "F32", 1e-4), ("qwen3_moe", "Q8_0", 0.25),
                                                  ("olmoe", "Q8_0", 0.25)])
def test_gguf_moe_matches_hf(tmp_path, monkeypatch, arch, qtype, loose_tol):
    # Q8_0 attention linears stay in their blocks (the default); fp32 activations keep this exact.
    monkeypatch.setenv("SHARDSERVE_GGUF_ACTIVATIONS", "fp32")
    ckpt_dir = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch)
    path = str(tmp_path / f"tiny-{arch}-{qtype}.gguf")
    write_moe_gguf(ckpt_dir, path, qtype)
    llm = _llm(path)
    prompt = random_prompt(11, 40)
    ours = prompt_logprobs(llm, prompt)
    # HF on exactly the weights the file holds: tight whatever the storage type.
    hf = hf_with_roundtripped_weights(ckpt_dir, qtype)
    diff = (ours - hf_logprobs(hf, prompt)[:len(prompt) - 1]).abs().max().item()
    assert diff <= 1e-4, f"{arch} {qtype}: log-probs differ from HF on the same weights by {diff:.2e}"
    # The original full-precision model: within the storage type's error at the typical position
    # (rounding can flip a near-tie between two experts at a few positions, a jump of its own).
    per_position = (ours - hf_logprobs(load_hf_model(ckpt_dir), prompt)[:len(prompt) - 1]).abs().amax(dim=-1)
    diff = per_position.median().item()
    assert diff <= loose_tol, f"{arch} {qtype}: log-probs are {diff:.3f} away from the original model"
    if qtype != "F32":
        assert diff > 1e-6, "a quantized file should not reproduce the original exactly"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 8)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_gguf_moe_config_from_metadata(tmp_path, arch):
    """num_experts / top_k / expert width, renormalisation and dense layers come from the metadata
    and the tensors present; the stacked expert tensors come back in torch order."""
    ckpt_dir = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_moe_gguf(ckpt_dir, path, "F32")
    reader = gguf_loader.open_gguf(path)
    cfg = gguf_loader.gguf_to_hf_config(reader)
    hf_cfg = load_hf_model(ckpt_dir).config
    spec = LlamaSpec.from_hf(cfg)
    assert spec.architecture == hf_cfg.architectures[0]
    num_experts = getattr(hf_cfg, "num_experts", None) or hf_cfg.num_local_experts
    width = getattr(hf_cfg, "moe_intermediate_size", None) or hf_cfg.intermediate_size
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.intermediate_size) == (
        num_experts, hf_cfg.num_experts_per_tok, width)
    assert spec.moe.renormalize == (arch != "olmoe")
    assert spec.moe.sparse_layers == ((True, False) if arch == "qwen3_moe" else (True, True))
    assert spec.intermediate_size == hf_cfg.intermediate_size
    assert spec.qk_norm == {"qwen3_moe": "head", "mixtral": None, "olmoe": "full"}[arch]
    assert spec.clip_qkv == (3.0 if arch == "olmoe" else None)
    weights = dict(gguf_loader.iter_gguf_weights(reader, cfg, lambda n: "layers.0.mlp" in n))
    hidden = spec.hidden_size
    assert weights["model.layers.0.mlp.gate.weight"].shape == (num_experts, hidden)
    assert weights["model.layers.0.mlp.experts.gate_proj.weight"].shape == (num_experts, width, hidden)
    assert weights["model.layers.0.mlp.experts.up_proj.weight"].shape == (num_experts, width, hidden)
    assert weights["model.layers.0.mlp.experts.down_proj.weight"].shape == (num_experts, hidden, width)


def _header_only(path: str, arch: str, **experts: int) -> str:
    import gguf
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_vocab_size(16)
    for key, value in experts.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,experts,message", [
    ("qwen3", dict(expert_count=4, expert_used_count=2), "'qwen3' with 4 experts is not supported"),
    ("qwen3moe", dict(), "expert_count=0"),
    ("olmoe", dict(expert_count=4, expert_used_count=5), "expert_used_count <= expert_count"),
    ("qwen3moe", dict(expert_count=4, expert_used_count=2, expert_shared_count=1), "shared experts"),
    ("qwen2moe", dict(expert_count=4, expert_used_count=2), "'qwen2moe' is not supported"),
])
def test_gguf_moe_unsupported(tmp_path, arch, experts, message):
    path = _header_only(str(tmp_path / "bad.gguf"), arch, **experts)
    with pytest.raises(ValueError, match=message):
        gguf_loader.gguf_to_hf_config(gguf_loader.open_gguf(path))
