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


def _stored(base: str) -> tuple[int, int, bool] | None:
    """What the checkpoint stores for `base` under DYNAMIC (bits, group size, desc_act), spelled out."""
    if base.startswith("model.layers.0.self_attn."):
        return None
    if base.endswith("mlp.down_proj"):
        return 8, 64, False
    if base.startswith("model.layers.1.mlp.") and base.endswith(("gate_proj", "up_proj")):
        return 4, 32, True
    if base.endswith(("gate_proj", "up_proj")):
        return 4, 96, False   # group_size -1: one group over the 96 inputs
    return 4, 32, False


def _quantize(base: str, weight: torch.Tensor):
    bits, group, desc_act = _stored(base)
    return quantized_tensors("gptq", base, weight, group, desc_act, sym=False, bits=bits)


@pytest.mark.parametrize("tp", [1, 2])
def test_dynamic_overrides_match_hf_on_their_weights(tmp_path, tp):
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    config = {**gptq_config(32), "dynamic": DYNAMIC}
    dequantized = write_quantized_checkpoint(src, str(tmp_path / "gptq"), _quantize, config,
                                             select=lambda n: is_quantized_linear(n) and _stored(n[:-7]) is not None)
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
