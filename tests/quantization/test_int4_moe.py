"""INT4 (GPTQ / AWQ) mixture-of-experts weights on the CPU path (quantization/int4_moe.py): the expert
layout against quantization/int4.py's dequantization, Qwen3-MoE / Mixtral / OLMoE checkpoints written
by round-to-nearest in the tools' layouts against HF transformers on the dequantized weights (group
sizes, v1/v2 zeros, desc_act per expert), TP=2 (cutting w2's groups; desc_act) and TP=2 + EP over
real gloo processes giving one process's greedy tokens, the experts held at ~0.27x bf16's bytes, the refusals."""
from __future__ import annotations

import pytest
import torch

from shardserve.kernels.moe import reference, torch_moe
from shardserve.kernels.moe.int4_experts import Int4Experts, pack_along_k, unpack_along_k
from shardserve.layers.moe import FusedMoE
from shardserve.llm import LLM
from shardserve.quantization.int4 import dequantize
from shardserve.sampling_params import SamplingParams
from tests.models.test_parity import assert_matches_hf, full_logprob_params, random_prompt
from tests.quantization.moe_checkpoints import write_int4_moe_checkpoint, write_with_weights
from tests.tiny_models import load_hf_model, make_tiny_checkpoint

KW = dict(kv_cache_memory="16MiB", show_progress=False)


def _experts(llm: LLM) -> list[FusedMoE]:
    model = llm.engine.executor.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def test_expert_layout_dequantizes_like_the_dense_layers():
    """Words packed along K, per-expert group rows (activation order included), and the torch path
    that widens one expert at a time: all equal to dequantize-then-reference."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (3, 16, 64), generator=gen)          # [E, N, K]
    assert torch.equal(unpack_along_k(pack_along_k(q[0])), q[0].int())
    zeros = torch.randint(0, 16, (3, 2, 16), generator=gen)        # [E, G, N]
    scales = torch.rand(3, 2, 16, generator=gen).half()
    index = torch.stack([torch.randperm(64, generator=gen) // 32 for _ in range(3)]).int()
    experts = Int4Experts(torch.stack([pack_along_k(w) for w in q]), scales, zeros.to(torch.uint8), index)
    assert experts.shape == (3, 16, 64)
    for e in range(3):
        want = dequantize(q[e].t().int(), zeros[e].int(), scales[e].float(), index[e].long(), torch.float32)
        assert torch.equal(experts.dequantize(e, torch.float32), want)
    w2 = Int4Experts(torch.stack([pack_along_k(w) for w in torch.randint(0, 16, (3, 64, 8), generator=gen)]),
                     torch.rand(3, 1, 64, generator=gen), torch.full((3, 1, 64), 8, dtype=torch.uint8),
                     torch.zeros(8, dtype=torch.int32).expand(3, 8))   # one group row shared over experts
    x = torch.randn(5, 64, generator=gen)
    weights, ids = reference.route_topk(torch.randn(5, 3, generator=gen), 2, True)
    ids[1, 0] = -1   # a pick another expert-parallel rank holds
    got = torch_moe.fused_moe(x, experts, w2, weights, ids)
    want = reference.fused_moe(x, experts.dequantize_all(), w2.dequantize_all(), weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch,fmt,group,desc_act,sym", [
    ("qwen3_moe", "gptq", 32, False, True),     # the Hub's usual GPTQ: symmetric, v1 zeros
    ("qwen3_moe", "awq", 32, False, False),
    ("mixtral", "gptq_v2", 64, False, False),   # w1/w3/w2 names, zero biases; 96 inputs: a shorter last group
    ("olmoe", "gptq", 32, True, False),         # activation order, each expert its own
])
def test_int4_moe_checkpoint_matches_hf_on_its_weights(tmp_path, arch, fmt, group, desc_act, sym):
    src = make_tiny_checkpoint(str(tmp_path / "src"), arch)
    dequantized = write_int4_moe_checkpoint(src, str(tmp_path / fmt), fmt, group, desc_act=desc_act, sym=sym,
                                            expert_bias=arch == "mixtral")
    assert any(".experts.3." in name for name in dequantized)
    hf = load_hf_model(write_with_weights(src, str(tmp_path / "dequantized"), dequantized))
    llm = LLM(str(tmp_path / fmt), max_logprobs=-1, **KW)
    layer = _experts(llm)[0]
    assert layer.w13_qweight.dtype == torch.int32 and not hasattr(layer, "w13_weight")
    assert layer.w13_zeros.dtype == torch.uint8
    prompt = random_prompt(3, 40)
    out = llm.generate([prompt], full_logprob_params())[0]
    llm.engine.shutdown()
    assert_matches_hf(out, hf, prompt)


def _expert_bytes(llm: LLM) -> int:
    """Bytes of every tensor the expert layers hold (a row expanded over the experts counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for layer in _experts(llm)
                for t in (*layer.parameters(), *layer.buffers()) if t.dim() >= 2}
    return sum(storages.values())


def test_int4_experts_take_about_a_quarter_of_bf16(tmp_path):
    """Group 128 over 256 hidden / 128 intermediate inputs: half a byte per weight plus an fp16 scale
    and a uint8 zero per 128: 0.5 + 3 / 128 bytes against bf16's 2, 0.262x (plus one shared int32 group
row per input, 0.1% here)."""
    shape = dict(hidden_size=256, moe_intermediate_size=128)
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen3_moe", **shape)
    write_int4_moe_checkpoint(src, str(tmp_path / "gptq"), "gptq", 128, sym=True)
    bf16 = LLM(src, dtype="bfloat16", **KW)
    bf16_bytes = _expert_bytes(bf16)
    bf16.engine.shutdown()
    int4 = LLM(str(tmp_path / "gptq"), dtype="bfloat16", **KW)
    int4_bytes = _expert_bytes(int4)
    tokens = int4.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    int4.engine.shutdown()
    ratio = int4_bytes / bf16_bytes
    print(f"INT4 experts: {int4_bytes} bytes, bf16: {bf16_bytes}, {ratio:.3f}x")
    assert ratio == pytest.approx((0.5 + 3 / 128) / 2, rel=5e-3) and len(tokens[0].outputs[0].token_ids) == 3


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 200, 100, 42] * 3, list(range(1, 10)), [300, 12, 7] * 9]


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def gptq_qwen3_moe(tmp_path_factory):
    """(path, one process's greedy tokens) per desc_act. Group 64 over the 64 intermediate inputs:
    TP=2 cuts w2's one group between the ranks; with desc_act (group 32) each rank keeps every group."""
    made: dict[bool, tuple[str, list[list[int]]]] = {}

    def make(desc_act: bool) -> tuple[str, list[list[int]]]:
        if desc_act not in made:
            root = tmp_path_factory.mktemp("int4_moe")
            src = make_tiny_checkpoint(str(root / "src"), "qwen3_moe", num_hidden_layers=4)
            write_int4_moe_checkpoint(src, str(root / "gptq"), "gptq", 32 if desc_act else 64, desc_act=desc_act)
            llm = LLM(str(root / "gptq"), **KW)
            try:
                made[desc_act] = str(root / "gptq"), _greedy(llm)
            finally:
                llm.engine.shutdown()
        return made[desc_act]
    return make


@pytest.mark.parametrize("tp,ep,desc_act", [(2, False, False), (2, True, False), (2, False, True)])
def test_int4_experts_sharded_match_one_process(gptq_qwen3_moe, tp, ep, desc_act):
    path, want = gptq_qwen3_moe(desc_act)
    llm = LLM(path, tensor_parallel_size=tp, enable_expert_parallel=ep, **KW)
    try:
        assert _greedy(llm) == want
        shapes = llm.engine.executor.collective_rpc("weight_shapes")
    finally:
        llm.engine.shutdown()
    experts, width = (4, 64) if ep else (8, 32)
    for rank_shapes in shapes:
        assert rank_shapes["model.layers.0.mlp.experts.w13_qweight"] == (experts, 2 * width, 96 // 8)
        assert rank_shapes["model.layers.0.mlp.experts.w2_qweight"] == (experts, 96, width // 8)
        # The cut group's row; with desc_act every group of the 64 inputs.
        assert rank_shapes["model.layers.0.mlp.experts.w2_scales"] == (experts, 2 if desc_act else 1, 96)
        assert rank_shapes["model.layers.0.mlp.gate.weight"] == (8, 96)                  # router: full precision


def _int4_layer(intermediate: int = 64, desc_act: bool = False) -> FusedMoE:
    from shardserve.layers.linear import linear_methods
    from shardserve.quantization.config import linear_method_factory
    from shardserve.quantization.int4 import GptqConfig
    config = GptqConfig(32, desc_act=desc_act)
    with linear_methods(linear_method_factory(config)):
        return FusedMoE(4, 2, 96, intermediate, renormalize=True, prefix="model.layers.3.mlp.experts")


def test_unsupported_int4_experts_are_refused():
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.experts: 20 intermediate rows .* multiples of 8"):
        _int4_layer(20)
    layer = _int4_layer(desc_act=True)
    with pytest.raises(ValueError, match="stacked in one tensor are not supported"):
        layer.w13_qweight.weight_loader(layer.w13_qweight, torch.zeros(4, 12, 128, dtype=torch.int32), (None, "gate"))
    g_idx = torch.arange(96, dtype=torch.int32) // 32
    layer.w13_g_idx.weight_loader(layer.w13_g_idx, g_idx, (1, "gate"))
    with pytest.raises(ValueError, match="g_idx of expert 1's up differs"):
        layer.w13_g_idx.weight_loader(layer.w13_g_idx, g_idx.flip(0), (1, "up"))
    with pytest.raises(ValueError, match=r"down scales has 3 groups; expected 2"):
        layer.w2_scales.weight_loader(layer.w2_scales, torch.ones(3, 96), (0, "down"))
    layer.w13_bias.weight_loader(layer.w13_bias, torch.zeros(64), (2, "up"))   # AutoGPTQ's zeros: fine
    with pytest.raises(ValueError, match="expert 2's up projection has a nonzero bias"):
        layer.w13_bias.weight_loader(layer.w13_bias, torch.ones(64), (2, "up"))


def test_awq_router_and_expert_exclusions():
    """AutoAWQ writes modules_to_not_convert ["gate"] for MoE models: the routers, full precision here
    anyway. Experts it leaves out run unquantized, all of one layer's or none: one FusedMoE holds
    every expert in one layout."""
    import json

    from shardserve.layers.moe import FusedMoE
    from shardserve.models.loader import build_model
    from shardserve.quantization.int4_moe import Int4MoEMethod
    from tests.quantization.int4_checkpoints import awq_config
    from tests.tiny_models import tiny_hf_config
    hf_config = json.loads(tiny_hf_config("qwen3_moe").to_json_string())
    model = None

    def experts_methods(left_out: list[str]) -> set[type]:
        hf_config["quantization_config"] = {**awq_config(32), "modules_to_not_convert": left_out}
        nonlocal model
        model = build_model(hf_config, torch.float32, torch.device("cpu"))
        return {type(m.quant_method) for m in model.modules() if isinstance(m, FusedMoE)}
    assert experts_methods(["gate"]) == {Int4MoEMethod}
    assert experts_methods(["gate", r".*\.experts"]) == {type(None)}   # (and the native CPU kernels repack them:)
    assert all(m.packed_expert_weights == FusedMoE.packed_expert_weights for m in model.modules()
               if isinstance(m, FusedMoE))
    with pytest.raises(ValueError, match=r"experts of model.layers.0.mlp.experts in several schemes \(some of th"):
        experts_methods([r".*\.experts\.1"])
