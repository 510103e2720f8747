"""GPTQModel's per-module overrides (`quantization_config.dynamic`): layers left unquantized ("-:"),
others with their own bits, group size or activation order, against HF transformers on the same
dequantized weights; fused parts that disagree refused."""
from __future__ import annotations

import json

import pytest
import torch

from shardserve.llm import LLM
from shardserve.models.loader import build_model
from shardserve.quantization.int4 import GptqConfig, Int4LinearMethod
from tests.models.test_parity import assert_matches_hf, full_logprob_params, random_prompt
from tests.quantization.checkpoints import hf_with_weights, is_quantized_linear, write_quantized_checkpoint
from tests.quantization.int4_checkpoints import gptq_config, quantized_tensors
from tests.tiny_models import make_tiny_checkpoint, tiny_hf_config

KW = dict(kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)

DYNAMIC = {   # as GPTQModel writes them: regexes from the module name's start, the first match decides
    r"-:model\.layers\.0\.self_attn\..*": {},
    r"+:.*\.mlp\.down_proj": {"bits": 8, "group_size": 64, "sym": True},
    r"model\.layers\.1\.mlp\.(gate|up)_proj": {"desc_act": True},
    r"+:.*\.mlp\.(gate|up)_proj": {"group_size": -1},
}


def _stored(base: str) -> tuple[int, int | None, bool] | None:
    """What the checkpoint stores for `base` under DYNAMIC (bits, group size: None for one group,
    desc_act), spelled out."""
    if base.startswith("model.layers.0.self_attn."):
        return None
    if base.endswith("mlp.down_proj"):
        return 8, 64, False
    if base.startswith("model.layers.1.mlp.") and base.endswith(("gate_proj", "up_proj")):
        return 4, 32, True
    if base.endswith(("gate_proj", "up_proj")):
        return 4, None, False   # group_size -1: one group over the inputs
    return 4, 32, False


def _quantize(base: str, weight: torch.Tensor):
    bits, group, desc_act = _stored(base)
    return quantized_tensors("gptq", base, weight, group or weight.shape[1], desc_act, sym=False, bits=bits)


def _write(src: str, dst: str) -> dict[str, torch.Tensor]:
    return write_quantized_checkpoint(src, dst, _quantize, {**gptq_config(32), "dynamic": DYNAMIC},
                                      select=lambda n: is_quantized_linear(n) and _stored(n[:-7]) is not None)


@pytest.mark.parametrize("tp", [1, 2])
def test_dynamic_overrides_match_hf_on_their_weights(tmp_path, tp):
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    dequantized = _write(src, str(tmp_path / "gptq"))
    llm = LLM(str(tmp_path / "gptq"), tensor_parallel_size=tp, **KW)
    try:
        if tp == 1:
            layers = llm.engine.executor.worker.model_runner.model.model.layers
            assert layers[0].self_attn.qkv_proj.quant_method is None
            assert isinstance(layers[1].self_attn.qkv_proj.quant_method, Int4LinearMethod)
            down, gate_up = layers[0].mlp.down_proj.quant_method, layers[1].mlp.gate_up_proj.quant_method
            assert (down.bits, down.config.group_size) == (8, 64) and gate_up.config.desc_act
            assert layers[0].mlp.gate_up_proj.quant_method.config.group_size is None
        prompt = random_prompt(3, 40)
        assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf_with_weights(src, dequantized), prompt)
    finally:
        llm.engine.shutdown()


def test_dynamic_rules_and_refusals():
    config = GptqConfig.from_quantization_config({**gptq_config(128), "lm_head": True, "dynamic": {
        r"-:.*layers\.3\.": {}, r"lm_head": {"bits": 8}, r".*\.o_proj": {"group_size": 32, "desc_act": True}}})
    assert config.scheme_for("model.layers.3.self_attn.o_proj") is None        # the first match decides
    assert config.scheme_for("model.layers.2.self_attn.o_proj") == (4, 32, True)
    assert config.scheme_for("model.layers.2.self_attn.q_proj") == config.scheme == (4, 128, False)
    assert config.scheme_for("lm_head") == (8, 128, False)
    assert not any(c.scheme_for("lm_head") for c in [GptqConfig.from_quantization_config(gptq_config(128))])
    for dynamic, message in (({r".*": {"bits": 3}}, r"bits=3 are not supported"),
                             ({r"+:.*(": {}}, "is not a regular expression"),
                             ({r".*": {"group_size": 0}}, "group_size=0 is not supported")):
        with pytest.raises(ValueError, match=message):
            GptqConfig.from_quantization_config({**gptq_config(128), "dynamic": dynamic})
    hf_config = json.loads(tiny_hf_config("llama").to_json_string())
    hf_config["quantization_config"] = {**gptq_config(32), "dynamic": {r".*\.k_proj": {"group_size": 96}}}
    with pytest.raises(ValueError, match="stores in different schemes the fused layer model.layers.0.self_attn.qkv"):
        build_model(hf_config, torch.float32, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dynamic_overrides_on_cuda_track_hf(tmp_path):
    """On the GPU (bf16, CUDA graphs): 4-bit layers on the W4A16 kernels (one with activation order),
    8-bit ones dequantized at load, the left-out attention in bf16, side by side; against HF in fp32
    on the dequantized weights over the whole vocabulary, as test_int4.py's CUDA test."""
    import gc

    from tests.models.test_parity import hf_logprobs, logprob_matrix
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama", hidden_size=256, intermediate_size=512)
    hf = hf_with_weights(src, _write(src, str(tmp_path / "gptq")))
    llm = LLM(str(tmp_path / "gptq"), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3,
              show_progress=False, max_logprobs=-1)
    try:
        layers = llm.engine.executor.worker.model_runner.model.model.layers
        assert layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
        assert layers[1].self_attn.qkv_proj.qweight.dtype == torch.int32
        assert layers[0].mlp.down_proj.weight.dtype == torch.bfloat16   # 8-bit: dequantized
        prompt = random_prompt(1, 40)
        out = llm.generate([prompt], full_logprob_params(max_tokens=8), use_tqdm=False)[0]
        ids = prompt + list(out.outputs[0].token_ids)
        ours = torch.cat([logprob_matrix(out.prompt_logprobs[1:]), logprob_matrix(out.outputs[0].logprobs)])
        diff = (ours - hf_logprobs(hf, ids)[:len(ids) - 1]).abs().max()
        assert diff < 0.15, f"GPTQ dynamic log-probs on CUDA are {diff:.3f} away from HF on the dequantized weights"
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_dynamic_experts_take_their_own_scheme():
    """Experts a `dynamic` override gives their own group size or bits take them (INT4 experts' method,
    also where the model's linears are 8-bit, which experts cannot be); 8-bit experts have no method
    (refused); all of one layer's experts share one scheme."""
    from shardserve.layers.moe import FusedMoE
    hf_config = json.loads(tiny_hf_config("qwen3_moe").to_json_string())

    def build(dynamic: dict, bits: int = 4):
        hf_config["quantization_config"] = {**gptq_config(32, bits=bits), "dynamic": dynamic}
        model = build_model(hf_config, torch.float32, torch.device("cpu"))
        return [m for m in model.modules() if isinstance(m, FusedMoE)], model.model.layers[0].self_attn.qkv_proj
    experts, qkv = build({r"+:.*\.experts\..*": {"group_size": 64}})
    assert {m.quant_method.config.group_size for m in experts} == {64} and qkv.quant_method.config.group_size == 32
    with pytest.raises(ValueError, match=r"8-bit GPTQ weights for the experts of a mixture-of-experts layer"):
        build({r".*\.experts\..*": {"bits": 8}})
    experts, qkv = build({r".*\.experts\..*": {"bits": 4}}, bits=8)   # built in 8 bits, which experts cannot be
    assert {m.quant_method.config.bits for m in experts} == {4} and qkv.quant_method.bits == 8
    with pytest.raises(ValueError, match=r"experts of model.layers.0.mlp.experts in several schemes: not supported"):
        build({r".*\.experts\.0\.down_proj": {"group_size": 64}})
