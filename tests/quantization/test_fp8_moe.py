"""FP8 mixture-of-experts weights on the CPU path (quantization/fp8_moe.py): `--quantization fp8` on a
full-precision Qwen3-MoE / Mixtral, and FP8 checkpoints with per-tensor or per-channel expert scales,
against HF transformers on the same rounded weights; the experts held in E4M3 (half of bf16's bytes);
TP and EP over real gloo processes give one process's greedy tokens; formats not read are refused."""
from __future__ import annotations

import json

import pytest
import torch

from shardserve.layers.moe import FusedMoE
from shardserve.llm import LLM
from shardserve.quantization.fp8 import FP8
from shardserve.sampling_params import SamplingParams
from tests.models.test_parity import assert_matches_hf, full_logprob_params, hf_logprobs, random_prompt
from tests.quantization.checkpoints import _state_dict, is_quantized_linear
from tests.quantization.moe_checkpoints import EXPERT, fp8_rows, write_fp8_moe_checkpoint, write_with_weights
from tests.tiny_models import load_hf_model, make_tiny_checkpoint

KW = dict(kv_cache_memory="16MiB", show_progress=False)


def _experts(llm: LLM) -> list[FusedMoE]:
    model = llm.engine.executor.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_online_fp8_experts_match_hf_on_the_rounded_weights(tmp_path, arch):
    """--quantization fp8: experts and dense linears rounded per output row; the logits stay within
    what that rounding allows of the full-precision model's."""
    path = make_tiny_checkpoint(str(tmp_path / arch), arch)
    rounded = {n: fp8_rows(t) for n, t in _state_dict(path).items() if EXPERT.search(n) or is_quantized_linear(n)}
    hf = load_hf_model(write_with_weights(path, str(tmp_path / "rounded"), rounded))
    llm = LLM(path, quantization="fp8", max_logprobs=-1, **KW)
    assert all(m.w13_weight.dtype == FP8 and m.w2_weight.dtype == FP8 for m in _experts(llm))
    prompt = random_prompt(3, 40)
    out = llm.generate([prompt], full_logprob_params())[0]
    llm.engine.shutdown()
    assert_matches_hf(out, hf, prompt)
    # Against the unrounded model: E4M3 keeps 3 mantissa bits, so each weight is off by at most 2^-4
    # of its value; summed over many weights the errors partly cancel, so the logits move far less.
    full = hf_logprobs(load_hf_model(path), prompt)
    fp8 = hf_logprobs(hf, prompt)
    rel = ((fp8 - full).norm() / full.norm()).item()
    assert rel <= 2 ** -4, f"FP8 log-probs moved {rel:.3%} from full precision"


@pytest.mark.parametrize("arch,per_channel", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)])
def test_fp8_moe_checkpoint_matches_hf_on_its_weights(tmp_path, arch, per_channel):
    src = make_tiny_checkpoint(str(tmp_path / "src"), arch)
    dequantized = write_fp8_moe_checkpoint(src, str(tmp_path / "fp8"), per_channel)
    hf = load_hf_model(write_with_weights(src, str(tmp_path / "dequantized"), dequantized))
    llm = LLM(str(tmp_path / "fp8"), max_logprobs=-1, **KW)
    layer = _experts(llm)[0]
    assert layer.w13_weight.dtype == FP8 and layer.w13_weight_scale.shape == layer.w13_weight.shape[:2]
    assert not hasattr(layer, "w13_input_scale")   # static activation scales: read, dropped
    prompt = random_prompt(4, 40)
    out = llm.generate([prompt], full_logprob_params())[0]
    llm.engine.shutdown()
    assert_matches_hf(out, hf, prompt)


def test_expert_scale_loader_takes_per_tensor_per_channel_and_stacked():
    """One value per output row of each expert, whatever the checkpoint's granularity; a scale of any
    other size is refused naming the layer (block-wise scales arrive per channel: test_fp8.py)."""
    from shardserve.layers.linear import linear_methods
    from shardserve.quantization.config import linear_method_factory
    from shardserve.quantization.fp8 import Fp8Config
    with linear_methods(linear_method_factory(Fp8Config(from_checkpoint=True))):
        layer = FusedMoE(4, 2, 16, 12, renormalize=True, prefix="model.layers.3.mlp.experts")
    scale = layer.w13_weight_scale
    layer.weight_loader(scale, torch.tensor(0.5), (0, "gate"))              # per tensor
    layer.weight_loader(scale, torch.arange(12.0).view(12, 1), (0, "up"))   # per channel, [rows, 1]
    assert torch.equal(scale[0], torch.cat([torch.full((12,), 0.5), torch.arange(12.0)]))
    stacked = torch.rand(4, 24)                                             # all experts' gate_up at once
    layer.weight_loader(scale, stacked, (None, "gate_up"))
    assert torch.equal(scale.data, stacked)
    layer.weight_loader(layer.w2_weight_scale, torch.tensor([2.0]), (1, "down"))
    assert torch.equal(layer.w2_weight_scale[1], torch.full((16,), 2.0))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.experts: an expert's gate scale has 3 values"):
        layer.weight_loader(scale, torch.ones(3), (2, "gate"))


def _expert_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes of the expert matrices, bytes of their scales) this process holds."""
    weights = scales = 0
    for layer in _experts(llm):
        for name, p in layer.named_parameters():
            size = p.numel() * p.element_size()
            if name.endswith("_scale"):
                scales += size
            else:
                weights += size
    return weights, scales


def test_fp8_experts_take_half_the_memory_of_bf16(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "m"), "qwen3_moe")
    bf16 = LLM(path, dtype="bfloat16", **KW)
    (bf16_bytes, _), bf16_tokens = _expert_bytes(bf16), _greedy(bf16)
    bf16.engine.shutdown()
    fp8 = LLM(path, dtype="bfloat16", quantization="fp8", **KW)
    (fp8_bytes, scale_bytes), fp8_tokens = _expert_bytes(fp8), _greedy(fp8)
    fp8.engine.shutdown()
    assert fp8_bytes * 2 == bf16_bytes
    # fp32 scales, one per row of each expert: 4 bytes per hidden-size (96) or intermediate (64) inputs.
    assert scale_bytes < 0.05 * fp8_bytes
    assert len(fp8_tokens[0]) == len(bf16_tokens[0])


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 200, 100, 42] * 3, list(range(1, 10)), [300, 12, 7] * 9]


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def fp8_qwen3_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_moe")
    src = make_tiny_checkpoint(str(root / "src"), "qwen3_moe", num_hidden_layers=4)
    write_fp8_moe_checkpoint(src, str(root / "fp8"), per_channel=True)
    llm = LLM(str(root / "fp8"), **KW)
    try:
        return str(root / "fp8"), _greedy(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tp,ep", [(2, False), (2, True)])
def test_fp8_experts_sharded_match_one_process(fp8_qwen3_moe, tp, ep):
    """TP slices every expert's intermediate rows and their scales; EP hands whole experts with their
    scales to each rank. Real worker processes over gloo."""
    path, reference = fp8_qwen3_moe
    llm = LLM(path, tensor_parallel_size=tp, enable_expert_parallel=ep, **KW)
    try:
        assert _greedy(llm) == reference
        shapes = llm.engine.executor.collective_rpc("weight_shapes")
    finally:
        llm.engine.shutdown()
    experts, width = (4, 64) if ep else (8, 32)
    for rank_shapes in shapes:
        assert rank_shapes["model.layers.0.mlp.experts.w13_weight_scale"] == (experts, 2 * width)
        assert rank_shapes["model.layers.0.mlp.experts.w2_weight_scale"] == (experts, 96)


def test_fp8_block_scaled_moe_checkpoint_matches_hf(tmp_path):
    """Qwen3-30B-A3B-FP8's layout: experts and dense linears with one scale per 32 x 32 block
    (`weight_scale_inv`), dequantized as they load and served as plain experts."""
    from tests.quantization.checkpoints import write_fp8_block_checkpoint
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    values = write_fp8_block_checkpoint(src, str(tmp_path / "fp8"), (32, 32))
    assert any(EXPERT.search(name) for name in values)
    hf = load_hf_model(write_with_weights(src, str(tmp_path / "values"), values))
    llm = LLM(str(tmp_path / "fp8"), max_logprobs=-1, **KW)
    assert all(m.quant_method is None and m.w13_weight.dtype == torch.float32 for m in _experts(llm))
    prompt = random_prompt(9, 40)
    out = llm.generate([prompt], full_logprob_params())[0]
    llm.engine.shutdown()
    assert_matches_hf(out, hf, prompt)


def test_unsupported_expert_formats_are_refused(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "m"), "qwen3_moe")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())   # (INT4 experts: tests/quantization/test_int4_moe.py)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2"}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FP8 format 'e5m2' is not supported"):
        LLM(path, **KW)
