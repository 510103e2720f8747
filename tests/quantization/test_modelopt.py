"""NVIDIA ModelOpt checkpoints (`quant_method: modelopt`), written as ModelOpt exports them, against HF
transformers on the checkpoint's values: FP8 (E4M3 weights with a per-tensor `weight_scale` and a
static `input_scale`, KV-cache scales on k_proj / v_proj, the config in `hf_quant_config.json` or in
config.json, `exclude_modules` by name and by `*` pattern, MoE experts) and NVFP4 (the
compressed-tensors library's NVFP4 values under ModelOpt's names and scale convention)."""
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
    if not in_config_json:
        _hf_quant_config(dst, quantization)
    return values


def _hf_quant_config(path: str, quantization: dict) -> None:
    """ModelOpt's own export: the config in hf_quant_config.json beside a config.json without one."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quantization}, f)


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
    mixed = {"quant_algo": "MIXED_PRECISION"}
    for quantization, message in (({"quant_algo": "INT4_AWQ"}, "quant_algo='INT4_AWQ' are not supported"),
                                  ({"quant_algo": "NVFP4", "group_size": 32}, "NVFP4 group_size=32"),
                                  ({**mixed, "quantized_layers": {"a.q_proj": {"quant_algo": "W4A8_AWQ"}}},
                                   r"quantized_layers\['a.q_proj'\].quant_algo='W4A8_AWQ' are not supported"),
                                  ({**mixed, "quantized_layers": {"q": {"quant_algo": "NVFP4", "group_size": 8}}},
                                   "NVFP4 group_size=8"),
                                  (mixed, "MIXED_PRECISION checkpoint without quantized_layers"),
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


def _as_modelopt_nvfp4(ct: str) -> None:
    """A compressed-tensors NVFP4 checkpoint rewritten under ModelOpt's names: `weight` for the packed
    values, the global divisor as its reciprocal multiplier `weight_scale_2`, hf_quant_config.json."""
    from safetensors.torch import load_file, save_file
    for f in [f for f in os.listdir(ct) if f.endswith(".safetensors")]:
        tensors = {}
        for name, t in load_file(os.path.join(ct, f)).items():
            if name.endswith(".weight_packed"):
                name = name[:-len("_packed")]
            elif name.endswith(".weight_global_scale"):
                name, t = name.replace("weight_global_scale", "weight_scale_2"), 1.0 / t
            tensors[name] = t
        save_file(tensors, os.path.join(ct, f))
    _hf_quant_config(ct, {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]})


@pytest.mark.parametrize("tp", [1, 2])
def test_modelopt_nvfp4_checkpoint_matches_hf_on_its_values(tmp_path, tp):
    pytest.importorskip("compressed_tensors")
    from shardserve.quantization.fp4 import Fp4LinearMethod
    from tests.quantization.ct_checkpoints import write_ct_checkpoint
    from tests.quantization.test_fp4 import _values
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    path = write_ct_checkpoint(src, str(tmp_path / "nvfp4"), "NVFP4A16", "nvfp4-pack-quantized", dtype=torch.float32)
    values = _values(path)   # (read in the library's layout, before the renaming)
    _as_modelopt_nvfp4(path)
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1, dtype="float32",
              tensor_parallel_size=tp)
    try:
        if tp == 1:
            qkv = llm.engine.executor.worker.model_runner.model.model.layers[0].self_attn.qkv_proj
            assert isinstance(qkv.quant_method, Fp4LinearMethod) and qkv.weight.dtype == torch.float32
        prompt = random_prompt(3, 40)
        assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf_with_weights(src, values), prompt)
    finally:
        llm.engine.shutdown()


FP8_LAYERS = ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj",
              "model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj")
PLAIN = ("model.layers.0.self_attn.o_proj",)   # in no `quantized_layers` entry: stored in 16 bits


def test_modelopt_mixed_precision_matches_hf_on_its_values(tmp_path):
    """`quant_algo: MIXED_PRECISION`: NVFP4 layers (the most, so the layers are built in NVFP4) named
    by layer or by a module holding them, FP8 ones by a module (layer 1's attention: its `self_attn`
    entry comes before layer 1's) or by layer (layer 0's down_proj: after its `mlp`'s), so the most
    specific entry decides, not the first or the last; layer 0's o_proj, in no entry, in 16 bits."""
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file, save_file

    from shardserve.quantization.fp4 import Fp4LinearMethod
    from shardserve.quantization.fp8 import Fp8LinearMethod
    from tests.quantization.checkpoints import _state_dict
    from tests.quantization.ct_checkpoints import write_ct_checkpoint
    from tests.quantization.test_fp4 import _values
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    path = write_ct_checkpoint(src, str(tmp_path / "mixed"), "NVFP4A16", "nvfp4-pack-quantized", dtype=torch.float32)
    values, original = _values(path), _state_dict(src)
    _as_modelopt_nvfp4(path)
    nvfp4 = sorted({n[:-len(".weight")] for n in values} - set(FP8_LAYERS) - set(PLAIN))
    (file,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    tensors = {n: t for n, t in load_file(os.path.join(path, file)).items()
               if not n.startswith(tuple(f"{b}." for b in FP8_LAYERS + PLAIN))}
    for base in FP8_LAYERS:
        fp8, values[f"{base}.weight"] = _fp8_tensors(base, original[f"{base}.weight"], static=True)
        tensors.update(fp8)
    for base in PLAIN:
        tensors[f"{base}.weight"] = original[f"{base}.weight"]
        del values[f"{base}.weight"]
    save_file(tensors, os.path.join(path, file))
    layers = {"model.layers.1.self_attn": {"quant_algo": "FP8"}, "model.layers.1": {"quant_algo": "NVFP4"},
              "model.layers.0.mlp": {"quant_algo": "NVFP4"}, "model.layers.0.mlp.down_proj": {"quant_algo": "FP8"},
              **{b: {"quant_algo": "NVFP4", "group_size": 16} for b in nvfp4 if ".layers.0.self_attn." in b}}
    assert set(nvfp4) == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                          "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.gate_proj",
                          "model.layers.0.mlp.up_proj", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj",
                          "model.layers.1.mlp.down_proj"}
    _hf_quant_config(path, {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers,
                            "exclude_modules": ["lm_head"]})
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1, dtype="float32")
    try:
        model = llm.engine.executor.worker.model_runner.model.model
        assert isinstance(model.layers[0].self_attn.qkv_proj.quant_method, Fp4LinearMethod)
        assert isinstance(model.layers[1].self_attn.qkv_proj.quant_method, Fp8LinearMethod)
        assert isinstance(model.layers[1].self_attn.o_proj.quant_method, Fp8LinearMethod)
        assert isinstance(model.layers[0].mlp.down_proj.quant_method, Fp8LinearMethod)
        assert model.layers[0].self_attn.o_proj.quant_method is None
        prompt = random_prompt(3, 40)
        assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf_with_weights(src, values), prompt)
    finally:
        llm.engine.shutdown()


def test_modelopt_mixed_precision_experts_take_their_own_algorithm():
    """FP8 experts (one entry for the module holding them) in a model built in NVFP4 (the attention's
    entries outnumber theirs): they take FP8's; NVFP4 experts NVFP4's (dequantized after loading)."""
    from shardserve.layers.moe import FusedMoE
    from shardserve.models.loader import build_model
    from shardserve.quantization.fp4_moe import Fp4MoEMethod
    from shardserve.quantization.fp8_moe import Fp8MoEMethod
    from tests.tiny_models import tiny_hf_config
    hf_config = json.loads(tiny_hf_config("qwen3_moe").to_json_string())
    attention = {f"model.layers.{i}.self_attn.{p}_proj": {"quant_algo": "NVFP4"} for i in (0, 1) for p in "qkvo"}

    def experts_methods(experts_algo: str) -> set[type]:
        hf_config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                            "quantized_layers": {**attention, "model.layers.0.mlp.experts": {
                                                "quant_algo": experts_algo}}}
        model = build_model(hf_config, torch.float32, torch.device("cpu"))
        return {type(m.quant_method) for m in model.modules() if isinstance(m, FusedMoE)}
    assert experts_methods("FP8") == {Fp8MoEMethod}
    assert experts_methods("NVFP4") == {Fp4MoEMethod}


def test_fp8_matmuls_are_refused_on_gpus_without_them(monkeypatch):
    """config.check_device on a compute capability 8.0 GPU: FP8 weights in any scheme (ModelOpt's
    MIXED_PRECISION included) are refused; block-scaled FP8 (widened at load) and NVFP4 (dequantized) pass."""
    from shardserve.quantization.config import check_device
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda")

    def check(cfg: dict) -> None:
        check_device(resolve_quantization(None, {"quantization_config": cfg}), cuda, torch.bfloat16)
    mixed = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}
    for cfg in ({"quant_method": "fp8"}, {"quant_method": "modelopt", "quant_algo": "FP8"},
                {**mixed, "quantized_layers": {"a": {"quant_algo": "NVFP4"}, "b": {"quant_algo": "FP8"}}}):
        with pytest.raises(ValueError, match="FP8 matmuls need a GPU of compute capability 8.9"):
            check(cfg)
    check({"quant_method": "fp8", "weight_block_size": [128, 128]})
    check({"quant_method": "modelopt", "quant_algo": "NVFP4"})
    check({**mixed, "quantized_layers": {"a": {"quant_algo": "NVFP4"}}})
