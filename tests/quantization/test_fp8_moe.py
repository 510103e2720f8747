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


@pytest.mark.parametrize("arch,per_channel,ct", [("qwen3_moe", False, False), ("qwen3_moe", True, False),
                                                 ("mixtral", True, False), ("qwen3_moe", True, True)])
def test_fp8_moe_checkpoint_matches_hf_on_its_weights(tmp_path, arch, per_channel, ct):
    """ct: compressed-tensors' FP8-dynamic (llm-compressor; the same per-expert tensors, no input scales)."""
    src = make_tiny_checkpoint(str(tmp_path / "src"), arch)
    dequantized = write_fp8_moe_checkpoint(src, str(tmp_path / "fp8"), per_channel, compressed_tensors=ct)
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
            if "_scale" in name:   # weight_scale, weight_scale_inv
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


def _one_process_tokens(root, write) -> tuple[str, list[list[int]]]:
    """A 4-layer tiny Qwen3-MoE written by write(src, dst), and its greedy tokens in one process."""
    src = make_tiny_checkpoint(str(root / "src"), "qwen3_moe", num_hidden_layers=4)
    write(src, str(root / "fp8"))
    llm = LLM(str(root / "fp8"), **KW)
    try:
        return str(root / "fp8"), _greedy(llm)
    finally:
        llm.engine.shutdown()


def _sharded_weight_shapes(path: str, reference: list[list[int]], tp: int, ep: bool) -> list[dict]:
    """Over TP (or EP) worker processes on gloo the checkpoint gives one process's greedy tokens; each
    rank's parameter shapes."""
    llm = LLM(path, tensor_parallel_size=tp, enable_expert_parallel=ep, **KW)
    try:
        assert _greedy(llm) == reference
        return llm.engine.executor.collective_rpc("weight_shapes")
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def fp8_qwen3_moe(tmp_path_factory):
    return _one_process_tokens(tmp_path_factory.mktemp("fp8_moe"),
                               lambda src, dst: write_fp8_moe_checkpoint(src, dst, per_channel=True))


@pytest.mark.parametrize("tp,ep", [(2, False), (2, True)])
def test_fp8_experts_sharded_match_one_process(fp8_qwen3_moe, tp, ep):
    """TP slices every expert's intermediate rows and their scales; EP hands whole experts with their
    scales to each rank."""
    shapes = _sharded_weight_shapes(*fp8_qwen3_moe, tp, ep)
    experts, width = (4, 64) if ep else (8, 32)
    for rank_shapes in shapes:
        assert rank_shapes["model.layers.0.mlp.experts.w13_weight_scale"] == (experts, 2 * width)
        assert rank_shapes["model.layers.0.mlp.experts.w2_weight_scale"] == (experts, 96)


def test_fp8_block_scaled_moe_checkpoint_matches_hf(tmp_path):
    """Qwen3-30B-A3B-FP8's layout: experts and dense linears with one scale per 32 x 32 block
    (`weight_scale_inv`); the experts stay E4M3 with their block scales (quantization/fp8_block_moe.py)."""
    from tests.quantization.checkpoints import write_fp8_block_checkpoint
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    values = write_fp8_block_checkpoint(src, str(tmp_path / "fp8"), (32, 32))
    assert any(EXPERT.search(name) for name in values)
    hf = load_hf_model(write_with_weights(src, str(tmp_path / "values"), values))
    llm = LLM(str(tmp_path / "fp8"), max_logprobs=-1, **KW)
    layer = _experts(llm)[0]
    assert layer.w13_weight.dtype == FP8 and layer.w2_weight.dtype == FP8
    # 64 gate + 64 up rows and 96 inputs: 2 + 2 block rows of 3 blocks; down: 3 block rows of 2
    assert layer.w13_weight_scale_inv.shape == (8, 4, 3) and layer.w2_weight_scale_inv.shape == (8, 3, 2)
    prompt = random_prompt(9, 40)
    out = llm.generate([prompt], full_logprob_params())[0]
    llm.engine.shutdown()
    assert_matches_hf(out, hf, prompt)


def _block_moe_layer(block: tuple[int, int]) -> FusedMoE:
    from shardserve.layers.linear import linear_methods
    from shardserve.quantization.config import linear_method_factory
    from shardserve.quantization.fp8 import Fp8Config
    with linear_methods(linear_method_factory(Fp8Config(from_checkpoint=False, block=block))):
        return FusedMoE(4, 2, 40, 24, renormalize=True, prefix="model.layers.3.mlp.experts")


def test_block_scales_load_compact_and_dequantize_to_the_checkpoint_values():
    """Each expert's block grids (gate / up [ceil(24 / 16), ceil(40 / 32)], down [ceil(40 / 16),
    ceil(24 / 32)], edge blocks partial) become its compact scales; dequantizing through the row map
    gives q times the block's scale for every weight, as the checkpoint defines it."""
    from shardserve.kernels.moe.reference import dequantize_experts
    layer = _block_moe_layer((16, 32))
    gen = torch.Generator().manual_seed(0)
    want = {"w13": torch.empty(4, 48, 40), "w2": torch.empty(4, 40, 24)}
    for expert in range(4):
        for kind, rows, cols in (("gate", 24, 40), ("up", 24, 40), ("down", 40, 24)):
            q = (torch.randn(rows, cols, generator=gen) * 100).clamp(-448, 448).to(FP8)
            grid = torch.rand(-(-rows // 16), -(-cols // 32), generator=gen) + 0.5
            name = "w2" if kind == "down" else "w13"
            layer.weight_loader(getattr(layer, f"{name}_weight"), q, (expert, kind))
            scale = getattr(layer, f"{name}_weight_scale_inv")
            scale.weight_loader(scale, grid, (expert, kind))
            value = q.float() * grid.repeat_interleave(16, 0)[:rows].repeat_interleave(32, 1)[:, :cols]
            if kind == "down":
                want["w2"][expert] = value
            else:
                want["w13"][expert, (kind == "up") * 24:][:24] = value
    layer.quant_method.process_after_loading(layer)
    for name in ("w13", "w2"):
        got = dequantize_experts(getattr(layer, f"{name}_weight"), layer.quant_method.scales(layer, name))
        assert torch.equal(got, want[name])
    with pytest.raises(ValueError, match=r"expert 1's down weight_scale_inv has shape \(2, 1\); blocks of "
                                         r"\[16, 32\] over \[40, 24\] need \[3, 1\]"):
        layer.w2_weight_scale_inv.weight_loader(layer.w2_weight_scale_inv, torch.ones(2, 1), (1, "down"))


def test_fp8_block_experts_take_half_the_memory_of_bf16(tmp_path):
    from tests.quantization.checkpoints import write_fp8_block_checkpoint
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    write_fp8_block_checkpoint(src, str(tmp_path / "fp8"), (32, 32))
    bf16 = LLM(src, dtype="bfloat16", **KW)
    bf16_bytes = _expert_bytes(bf16)[0]
    bf16.engine.shutdown()
    fp8 = LLM(str(tmp_path / "fp8"), dtype="bfloat16", **KW)
    fp8_bytes, scale_bytes = _expert_bytes(fp8)
    fp8.engine.shutdown()
    assert fp8_bytes * 2 == bf16_bytes and scale_bytes < 0.05 * fp8_bytes


@pytest.fixture(scope="module")
def fp8_block_qwen3_moe(tmp_path_factory):
    """Blocks of 48 rows: at TP=2 the second rank's 32 gate (and up) rows of each expert start inside
    the first block of 48, so its row map points rows 32-47 and 48-63 at two block rows."""
    from tests.quantization.checkpoints import write_fp8_block_checkpoint
    return _one_process_tokens(tmp_path_factory.mktemp("fp8_block_moe"),
                               lambda src, dst: write_fp8_block_checkpoint(src, dst, (48, 32)))


@pytest.mark.parametrize("tp,ep", [(2, False), (2, True)])
def test_fp8_block_experts_sharded_match_one_process(fp8_block_qwen3_moe, tp, ep):
    shapes = _sharded_weight_shapes(*fp8_block_qwen3_moe, tp, ep)
    scales = [s["model.layers.0.mlp.experts.w13_weight_scale_inv"] for s in shapes]
    assert scales == ([(4, 4, 3)] * 2 if ep else [(8, 2, 3), (8, 4, 3)])   # rank 1's rows span two blocks
    assert all(s["model.layers.0.mlp.experts.w2_weight_scale_inv"] == ((4, 2, 2) if ep else (8, 2, 1))
               for s in shapes)


def test_fp8_block_experts_refuse_a_tp_that_cuts_their_input_blocks(tmp_path):
    """At TP=2 each rank holds 32 of the experts' 64 intermediate inputs, which blocks of 64 would cut."""
    from tests.quantization.checkpoints import write_fp8_block_checkpoint
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    write_fp8_block_checkpoint(src, str(tmp_path / "fp8"), (32, 64))
    with pytest.raises(Exception, match=r"experts: tensor_parallel_size=2 gives each rank 32 of the experts' 64 "
                                        r"intermediate inputs.*--enable-expert-parallel"):
        LLM(str(tmp_path / "fp8"), tensor_parallel_size=2, **KW)


def test_unsupported_expert_formats_are_refused(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "m"), "qwen3_moe")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())   # (INT4 experts: tests/quantization/test_int4_moe.py)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2"}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FP8 format 'e5m2' is not supported"):
        LLM(path, **KW)
