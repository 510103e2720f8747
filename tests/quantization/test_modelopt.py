"""NVIDIA ModelOpt FP8 checkpoints (`quant_method: modelopt`, `quant_algo: FP8`), written as ModelOpt
exports them: E4M3 weights with a per-tensor `weight_scale` and a static `input_scale`, KV-cache scales
on k_proj / v_proj, the config in `hf_quant_config.json` (or in config.json), `exclude_modules` by name
and by `*` pattern; against HF transformers on the checkpoint's values."""
from __future__ import annotations

import json
import os

import pytest
import torch

from shardserve.llm import LLM
from shardserve.quantization.config import resolve_quantization
from tests.models.test_parity import assert_matches_hf, full_logprob_params, random_prompt
from tests.quantization.checkpoints import (
    _fp8_tensors,
    hf_with_weights,
    is_quantized_linear,
    write_quantized_checkpoint,
)
from tests.tiny_models import make_tiny_checkpoint

EXCLUDE = ["lm_head", "model.layers.1.mlp*", "model.layers.0.self_attn.o_proj"]


def _excluded(name: str) -> bool:
    """The tensors EXCLUDE leaves in 16 bits, spelled out."""
    return name.startswith(("lm_head.", "model.layers.1.mlp.", "model.layers.0.self_attn.o_proj."))


def _modelopt_tensors(base: str, t: torch.Tensor):
    tensors, values = _fp8_tensors(base, t, static=True)
    if base.endswith(("k_proj", "v_proj")):   # kv_cache_quant_algo FP8: ModelOpt's KV-cache scales
        tensors[f"{base}.{base[-6]}_scale"] = torch.tensor(0.02)
    return tensors, values


def _write(src: str, dst: str, in_config_json: bool) -> dict[str, torch.Tensor]:
    quantization = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": EXCLUDE}
    values = write_quantized_checkpoint(src, dst, _modelopt_tensors, {"quant_method": "modelopt", **quantization},
                                        select=lambda n: is_quantized_linear(n) and not _excluded(n))
    if not in_config_json:   # ModelOpt's own export: the config beside config.json
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        del config["quantization_config"]
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quantization}, f)
    return values


@pytest.mark.parametrize("tp,in_config_json", [(1, False), (2, False), (1, True)])
def test_modelopt_fp8_checkpoint_matches_hf_on_its_values(tmp_path, tp, in_config_json):
    from shardserve.quantization.fp8 import Fp8LinearMethod
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    values = _write(src, str(tmp_path / "modelopt"), in_config_json)
    assert values and not any(_excluded(n) for n in values)
    llm = LLM(str(tmp_path / "modelopt"), kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1,
              tensor_parallel_size=tp)
    try:
        if tp == 1:
            layers = llm.engine.executor.worker.model_runner.model.model.layers
            assert isinstance(layers[0].self_attn.qkv_proj.quant_method, Fp8LinearMethod)
            assert isinstance(layers[0].mlp.down_proj.quant_method, Fp8LinearMethod)
            assert layers[0].self_attn.o_proj.quant_method is None and layers[1].mlp.gate_up_proj.quant_method is None
            assert float(layers[0].self_attn.attn.k_scale) == pytest.approx(0.02)   # the KV-cache scales read
        prompt = random_prompt(2, 40)
        assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf_with_weights(src, values), prompt)
    finally:
        llm.engine.shutdown()


def test_other_modelopt_algorithms_are_refused():
    for quantization, message in (({"quant_algo": "NVFP4"}, "quant_algo='NVFP4' are not supported"),
                                  ({"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
                                   "kv_cache_quant_algo='NVFP4' is not supported")):
        with pytest.raises(ValueError, match=message):
            resolve_quantization(None, {"quantization_config": {"quant_method": "modelopt",
                                                                "quantization": quantization}})
    config = resolve_quantization("modelopt", {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                                                       "exclude_modules": EXCLUDE}})
    assert config.ignores("lm_head") and config.ignores("model.layers.1.mlp.down_proj")
    assert config.ignores("model.layers.0.self_attn.o_proj") and not config.ignores("model.layers.0.self_attn.o_proj2")
    assert not config.ignores("model.layers.11.mlp.down_proj") and not config.ignores("model.layers.0.mlp.down_proj")


def test_modelopt_fp8_moe_checkpoint_matches_hf_on_its_values(tmp_path):
    """A Qwen3-MoE as ModelOpt exports it: per-tensor FP8 experts with static input scales (the FP8
    MoE method's tensors), the routers left out."""
    from tests.quantization.moe_checkpoints import (
        _set_quantization_config,
        write_fp8_moe_checkpoint,
        write_with_weights,
    )
    from tests.tiny_models import load_hf_model
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    values = write_fp8_moe_checkpoint(src, str(tmp_path / "modelopt"))
    _set_quantization_config(str(tmp_path / "modelopt"), {"quant_method": "modelopt", "quant_algo": "FP8",
                                                           "exclude_modules": ["lm_head", "*.mlp.gate"]})
    hf = load_hf_model(write_with_weights(src, str(tmp_path / "values"), values))
    llm = LLM(str(tmp_path / "modelopt"), kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    try:
        prompt = random_prompt(4, 40)
        assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf, prompt)
    finally:
        llm.engine.shutdown()
