"""FP8 mixture-of-experts checkpoints written the way AutoFP8 / vLLM (`quant_method: fp8`) write them
for Qwen3-MoE and Mixtral, and the same model with the rounded values in full precision for HF.

Per expert the checkpoint has `...experts.N.<proj>.weight` in E4M3 beside `.weight_scale` (fp32: one
value per tensor, or with `per_channel` one per output channel, shape [rows, 1] as llm-compressor
writes them) and a static `.input_scale`; the dense linears carry per-tensor scales as
tests/quantization/checkpoints.py writes them.

GPTQ / AWQ (INT4) MoE checkpoints as GPTQModel / AutoGPTQ and AutoAWQ write them: every expert
projection quantized on its own (`...experts.N.gate_proj.qweight / qzeros / scales [/ g_idx]`,
Mixtral `w1 / w3 / w2`), by round-to-nearest in the layouts of tests/quantization/int4_checkpoints.py;
the router (`mlp.gate`) left in full precision."""
from __future__ import annotations

import os
import re
import shutil

import torch

from tests.quantization.checkpoints import _fp8_tensors, _state_dict, is_quantized_linear, write_quantized_checkpoint
from tests.quantization.int4_checkpoints import awq_config, gptq_config, quantized_tensors

FP8_MAX = 448.0
EXPERT = re.compile(r"\.experts\.\d+\.\w+\.weight$")
EXPERT_NUMBER = re.compile(r"\.experts\.(\d+)\.")


# llm-compressor's FP8-dynamic scheme: weights per output channel, activations per token at run time
CT_FP8_DYNAMIC = {"quant_method": "compressed-tensors", "format": "float-quantized",
                  "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp.gate$"],
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}


def _expert_fp8(base: str, t: torch.Tensor, per_channel: bool,
                static: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    w = t.float()
    scale = (w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()) / FP8_MAX
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    tensors = {f"{base}.weight": q, f"{base}.weight_scale": scale if per_channel else scale.reshape(())}
    if static:
        tensors[f"{base}.input_scale"] = torch.tensor(0.05)
    return tensors, q.float() * scale


def write_fp8_moe_checkpoint(src: str, dst: str, per_channel: bool = False,
                             compressed_tensors: bool = False) -> dict[str, torch.Tensor]:
    """`src` with every expert and decoder linear in FP8; returns the dequantized weights by name.
    compressed_tensors: as llm-compressor's FP8-dynamic writes it (every linear per channel, no
    input scales, `CT_FP8_DYNAMIC`)."""
    from safetensors.torch import save_file
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, f), dst)
    out, dequantized = {}, {}
    for name, t in _state_dict(src).items():
        base = name[:-len(".weight")]
        if EXPERT.search(name) or (compressed_tensors and is_quantized_linear(name)):
            tensors, dequantized[name] = _expert_fp8(base, t, per_channel or compressed_tensors,
                                                     static=not compressed_tensors)
        elif is_quantized_linear(name):
            tensors, dequantized[name] = _fp8_tensors(base, t)
        else:
            tensors = {name: t}
        out.update(tensors)
    save_file(out, os.path.join(dst, "model.safetensors"))
    _set_quantization_config(dst, CT_FP8_DYNAMIC if compressed_tensors else {"quant_method": "fp8",
                                                                             "activation_scheme": "static"})
    return dequantized


def write_with_weights(src: str, dst: str, weights: dict[str, torch.Tensor]) -> str:
    """`src` as a full-precision checkpoint with some tensors replaced (HF then loads it its own way:
    transformers 5 stacks the experts, so swapping values into its state dict by name would not do)."""
    from safetensors.torch import save_file
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, f), dst)
    tensors = _state_dict(src)
    tensors.update({name: w.to(tensors[name].dtype) for name, w in weights.items()})
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def assert_moe_checkpoint_matches_hf(tmp_path, src: str, path: str, values: dict[str, torch.Tensor], tp: int,
                                     check_experts=None, **llm_kwargs) -> None:
    """The quantized MoE checkpoint at `path` served at TP `tp` gives HF transformers' log-probs on
    `src` with the values the quantized tensors hold swapped in. check_experts(model, experts) first,
    at TP=1 (experts: the model's FusedMoE layers)."""
    from shardserve.layers.moe import FusedMoE
    from shardserve.llm import LLM
    from tests.models.test_parity import assert_matches_hf, full_logprob_params, random_prompt
    from tests.tiny_models import load_hf_model
    hf = load_hf_model(write_with_weights(src, str(tmp_path / "values"), values))
    llm = LLM(path, tensor_parallel_size=tp, **llm_kwargs)
    try:
        if tp == 1 and check_experts is not None:
            model = llm.engine.executor.worker.model_runner.model
            experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
            assert experts
            check_experts(model, experts)
        prompt = random_prompt(5, 40)
        assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf, prompt)
    finally:
        llm.engine.shutdown()


def _set_quantization_config(path: str, cfg: dict) -> None:
    import json
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = cfg
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def fp8_rows(w: torch.Tensor) -> torch.Tensor:
    """What `--quantization fp8` computes with for a weight whose last dim is the input: every row
    rounded to E4M3 with its own absmax scale."""
    from shardserve.quantization.fp8 import quantize_rows
    flat = w.reshape(-1, w.shape[-1])
    q, scale = quantize_rows(flat)
    return (q.float() * scale[:, None]).reshape(w.shape)


def write_int4_moe_checkpoint(src: str, dst: str, fmt: str, group_size: int, desc_act: bool = False,
                              sym: bool = False, expert_bias: bool = False,
                              **config_overrides) -> dict[str, torch.Tensor]:
    """`src` with its experts and decoder linears in GPTQ (`fmt` "gptq" v1 or "gptq_v2") or AWQ ("awq").
    desc_act: each expert its own input order (GPTQ orders by the inputs an expert saw; its gate and
    up share one, down has its own). expert_bias: a `.bias` of fp16 zeros beside every expert
    projection, as older AutoGPTQ versions write them. Returns the dequantized weights by HF name."""
    config = {**(gptq_config(group_size, desc_act, sym, fmt) if fmt != "awq" else awq_config(group_size)),
              **config_overrides}

    def quantize(base: str, t: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        expert = EXPERT_NUMBER.search(base + ".")
        seed = None if expert is None else 1000 * (int(expert.group(1)) + 1) + t.shape[1]
        tensors, dequantized = quantized_tensors(fmt, base, t, group_size, desc_act, sym, seed=seed)
        if expert is not None and expert_bias:
            tensors[f"{base}.bias"] = torch.zeros(t.shape[0], dtype=torch.float16)
        return tensors, dequantized
    return write_quantized_checkpoint(src, dst, quantize, config,
                                      select=lambda name: bool(EXPERT.search(name)) or is_quantized_linear(name))
