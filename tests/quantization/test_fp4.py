"""FP4 compressed-tensors checkpoints (llm-compressor's NVFP4A16 / NVFP4 and MXFP4A16 / MXFP4 presets),
written by the compressed-tensors library, against HF transformers on the same values: the library's
own E2M1 unpacking, the scales applied in fp32 (transformers decompresses through bf16)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from shardserve.llm import LLM
from shardserve.quantization.fp4 import E2M1, Fp4LinearMethod, unpack_e2m1
from tests.models.test_parity import assert_matches_hf, full_logprob_params, random_prompt
from tests.quantization.checkpoints import hf_with_weights
from tests.quantization.ct_checkpoints import write_ct_checkpoint
from tests.tiny_models import make_tiny_checkpoint

pytest.importorskip("compressed_tensors")

KW = dict(kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1, dtype="float32")


def _values(path: str) -> dict[str, torch.Tensor]:
    """Each FP4 layer's weight from the checkpoint's tensors, decoded with the library's unpacking: NVFP4
    E4M3 scales over the global scale, MXFP4 E8M0 exponents (the library's own decoding)."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from safetensors.torch import load_file
    tensors = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, f)))
    out = {}
    for name, packed in tensors.items():
        if name.endswith(".weight_packed"):
            base = name[:-len(".weight_packed")]
            values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
            scale = tensors[f"{base}.weight_scale"]
            if scale.dtype == torch.uint8:   # MXFP4
                scale = decompress_mx_scale(scale).float()
            else:
                scale = scale.float() / tensors[f"{base}.weight_global_scale"].float()
            out[f"{base}.weight"] = values * scale.repeat_interleave(values.shape[1] // scale.shape[1], dim=1)
    return out


def test_unpacking_known_bytes():
    packed = torch.tensor([[0x21, 0xF8], [0x9A, 0x07]], dtype=torch.uint8)   # low nibble first; bit 3 the sign
    assert unpack_e2m1(packed).tolist() == [[E2M1[1], E2M1[2], -0.0, -E2M1[7]], [-E2M1[2], -E2M1[1], E2M1[7], 0.0]]


@pytest.mark.parametrize("preset,tp,head", [("NVFP4A16", 1, True), ("NVFP4A16", 2, False), ("NVFP4", 1, False),
                                            ("MXFP4A16", 1, True), ("MXFP4", 1, False)])
def test_fp4_checkpoint_matches_hf_on_its_values(tmp_path, preset, tp, head):
    """TP=2: the row-parallel layers' 48 and 96 inputs per rank take three and six of each row's 16-input
    NVFP4 scales; W4A4 presets: their activation quantization is not applied (the layers compute in
    the model's dtype)."""
    fmt = f"{preset[:5].lower()}-pack-quantized"
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    path = write_ct_checkpoint(src, str(tmp_path / "ct"), preset, fmt, ignore=() if head else ("lm_head",),
                               dtype=torch.float32)
    with open(f"{path}/config.json") as f:
        assert json.load(f)["quantization_config"]["config_groups"]["group_0"]["format"] == fmt
    values = _values(path)
    assert ("lm_head.weight" in values) == head
    llm = LLM(path, tensor_parallel_size=tp, **KW)
    try:
        if tp == 1:
            model = llm.engine.executor.worker.model_runner.model
            assert isinstance(model.model.layers[0].self_attn.qkv_proj.quant_method, Fp4LinearMethod)
            assert (model.lm_head.linear is not None) == head
        prompt = random_prompt(3, 40)
        assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf_with_weights(src, values), prompt)
    finally:
        llm.engine.shutdown()


def test_smollm2_nvfp4_answers(tmp_path):
    """The real SmolLM2 in NVFP4A16 (min-max scales, no calibration): answers Paris, with exactly the
    perplexity of its values in bf16 (+21% against the bf16 model)."""
    from shardserve.sampling_params import SamplingParams
    from tests.quantization.checkpoints import smollm2_hf_checkpoint
    from tests.quantization.moe_checkpoints import write_with_weights
    from tests.quantization.test_compressed_tensors import FRANCE, _perplexity
    smollm2 = smollm2_hf_checkpoint(str(tmp_path / "hf"))
    kw = dict(max_model_len=1024, kv_cache_memory="64MiB", show_progress=False)
    path = write_ct_checkpoint(smollm2, str(tmp_path / "nvfp4"), "NVFP4A16", "nvfp4-pack-quantized")
    values = {k: v.to(torch.bfloat16) for k, v in _values(path).items()}
    ppl = {}
    for name, where in (("bf16", smollm2), ("values", write_with_weights(smollm2, str(tmp_path / "v"), values)),
                        ("nvfp4", path)):
        llm = LLM(where, **kw)
        try:
            ppl[name] = _perplexity(llm)
            if name == "nvfp4":
                text = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
        finally:
            llm.engine.shutdown()
    print(f"perplexity {ppl}; {text!r}")
    assert "Paris" in text, text
    assert abs(ppl["nvfp4"] / ppl["values"] - 1) <= 0.005
    assert abs(ppl["nvfp4"] / ppl["bf16"] - 1) <= 0.3   # +21%: min-max scales, as W4A16's +25% (no calibration)


def test_other_fp4_layouts_are_refused():
    from shardserve.models.loader import build_model
    from shardserve.quantization.ct_scheme import parse
    from tests.tiny_models import tiny_hf_config

    def config(weights: dict, fmt: str = "nvfp4-pack-quantized") -> dict:
        return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}
    nvfp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    assert parse(config(nvfp4)).default.weights == "nvfp4"
    assert parse(config({**nvfp4, "strategy": "group", "group_size": 32}, "mxfp4-pack-quantized")).default.weights \
        == "mxfp4"
    with pytest.raises(ValueError, match="FP4 weights in format 'float-quantized' is not supported"):
        parse(config(nvfp4, "float-quantized"))
    with pytest.raises(ValueError, match=r"NVFP4 weights with strategy 'group' and group_size 32 \(tensor_group of 16"):
        parse(config({**nvfp4, "strategy": "group", "group_size": 32}))
    hf_config = json.loads(tiny_hf_config("qwen3_moe").to_json_string())
    hf_config["quantization_config"] = config(nvfp4)
    build_model(hf_config, torch.float32, torch.device("cpu"))   # FP4 experts (test_fp4_experts_match_hf_...)
    hf_config["moe_intermediate_size"] = 24   # down's inputs: one and a half NVFP4 scales
    with pytest.raises(ValueError, match=r"NVFP4 experts of model.layers.0.mlp.experts: 24 intermediate rows per rank"):
        build_model(hf_config, torch.float32, torch.device("cpu"))


def _fp4_tensors(base: str, t: torch.Tensor, kind: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One weight as llm-compressor stores it in NVFP4 (E4M3 scales per 16 inputs under a global
    divisor: `weight_global_scale`) or MXFP4 (E8M0 exponents per 32), min-max scales, E2M1 values
    rounded to the nearest and packed by the library; and the values it holds."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    w = t.float()
    n, k = w.shape
    group = 16 if kind == "nvfp4" else 32
    amax = w.reshape(n, k // group, group).abs().amax(-1)
    extra = {}
    if kind == "nvfp4":
        global_scale = 448 * 6 / w.abs().amax()
        stored = (amax / 6 * global_scale).to(torch.float8_e4m3fn)
        scale = stored.float() / global_scale
        extra[f"{base}.weight_global_scale"] = global_scale.reshape(1)
    else:
        exponent = torch.ceil(torch.log2(amax.clamp(min=1e-30) / 6))
        stored, scale = (exponent + 127).to(torch.uint8), torch.exp2(exponent)
    scale = scale.repeat_interleave(group, dim=1)
    x = (w / scale.clamp(min=1e-30)).clamp(-6, 6)
    grid = torch.tensor(E2M1)
    e2m1 = grid[(x.abs()[..., None] - grid).abs().argmin(-1)] * torch.where(x < 0, -1.0, 1.0)
    return {f"{base}.weight_packed": pack_fp4_to_uint8(e2m1), f"{base}.weight_scale": stored, **extra}, e2m1 * scale


def write_fp4_moe_checkpoint(src: str, path: str, kind: str) -> dict[str, torch.Tensor]:
    """`src` (a MoE model) with every linear and expert projection in FP4 ("nvfp4", "mxfp4", or
    "modelopt": NVFP4 under ModelOpt's names and scale convention), per expert as llm-compressor
    stores them; returns the values the quantized tensors hold."""
    from tests.quantization.checkpoints import is_quantized_linear, write_quantized_checkpoint
    from tests.quantization.moe_checkpoints import EXPERT
    from tests.quantization.test_modelopt import _as_modelopt_nvfp4
    fp4 = "nvfp4" if kind == "modelopt" else kind
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group" if fp4 == "nvfp4" else "group",
               "group_size": 16 if fp4 == "nvfp4" else 32}
    config = {"quant_method": "compressed-tensors", "format": f"{fp4}-pack-quantized",
              "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp.gate$"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    values = write_quantized_checkpoint(src, path, lambda base, t: _fp4_tensors(base, t, fp4), config,
                                        select=lambda n: bool(EXPERT.search(n)) or is_quantized_linear(n))
    if kind == "modelopt":
        _as_modelopt_nvfp4(path)
    return values


@pytest.mark.parametrize("kind,tp", [("nvfp4", 1), ("nvfp4", 2), ("mxfp4", 1), ("modelopt", 1)])
def test_fp4_experts_match_hf_on_their_values(tmp_path, kind, tp):
    """A tiny Qwen3-MoE with every linear and expert projection in FP4: the experts dequantized after
    loading, plain from then on; TP=2 cuts down's 64 inputs into 32 per rank, two NVFP4 scales each."""
    from tests.quantization.moe_checkpoints import assert_moe_checkpoint_matches_hf
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    path = str(tmp_path / kind)
    values = write_fp4_moe_checkpoint(src, path, kind)

    def plain(model, experts):
        assert all(m.quant_method is None and m.w13_weight.dtype == torch.float32 for m in experts)
    assert_moe_checkpoint_matches_hf(tmp_path, src, path, values, tp, plain, **KW)


def test_mxfp4_shards_cutting_a_scale_are_refused(tmp_path):
    """MXFP4 at TP=2 on the tiny model: o_proj's 48 inputs per rank cut a 32-input scale."""
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    path = write_ct_checkpoint(src, str(tmp_path / "ct"), "MXFP4A16", "mxfp4-pack-quantized", dtype=torch.float32)
    with pytest.raises(Exception, match="MXFP4 RowParallelLinear: 48 inputs per rank are not a multiple of 32"):
        LLM(path, tensor_parallel_size=2, **KW)
