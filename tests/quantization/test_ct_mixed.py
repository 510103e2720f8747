"""compressed-tensors mixed precision: several config groups, each layer in the scheme of its most
specific target (the library's precedence), against HF on the weights the library decompresses;
layouts the kernels cannot hold refused."""
from __future__ import annotations

import json

import pytest
import torch

from shardserve.llm import LLM
from shardserve.quantization.ct_scheme import parse
from tests.models.test_parity import assert_matches_hf, full_logprob_params, random_prompt
from tests.quantization.ct_checkpoints import write_ct_checkpoint
from tests.quantization.test_compressed_tensors import KW, _config, _int4
from tests.tiny_models import make_tiny_checkpoint, tiny_hf_config

pytest.importorskip("compressed_tensors")


MIXED = {   # llm-compressor's mixed-precision recipes: a scheme per part of the model
    "attention": (["re:.*self_attn.*"], "FP8_DYNAMIC", "float-quantized"),
    "mlp": (["re:.*mlp.*"], _int4(32), "pack-quantized"),
    "one layer": (["model.layers.1.mlp.down_proj"], dict(weights=dict(num_bits=8, type="int", strategy="channel",
                                                                      symmetric=False)), "int-quantized"),
    "the rest": (["Linear"], "W8A8", "int-quantized"),   # the LM head
}


@pytest.mark.parametrize("tp", [1, 2])
def test_mixed_precision_checkpoint_matches_hf(tmp_path, tp):
    """Several config groups (FP8 attention, INT4 MLP, one INT8 layer by name, W8A8 for the rest: the
    LM head): each layer in its group's scheme, against HF on the weights the library decompresses
    (transformers 5 reads such files with one compressor for every group)."""
    from transformers import AutoModelForCausalLM

    from shardserve.quantization.fp8 import Fp8LinearMethod
    from shardserve.quantization.int4 import Int4LinearMethod
    from shardserve.quantization.int8 import Int8LinearMethod
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    path = write_ct_checkpoint(src, str(tmp_path / "ct"), None, None, ignore=(), groups=MIXED, dtype=torch.float32)
    with open(f"{path}/config.json") as f:
        assert json.load(f)["quantization_config"]["format"] == "mixed-precision"
    llm = LLM(path, tensor_parallel_size=tp, **KW)
    try:
        if tp == 1:
            model = llm.engine.executor.worker.model_runner.model
            methods = {name: type(m.quant_method) for name, m in model.named_modules() if hasattr(m, "quant_method")}
            assert methods["model.layers.0.self_attn.qkv_proj"] is Fp8LinearMethod
            assert methods["model.layers.1.self_attn.o_proj"] is Fp8LinearMethod
            assert issubclass(methods["model.layers.0.mlp.gate_up_proj"], Int4LinearMethod)
            assert issubclass(methods["model.layers.0.mlp.down_proj"], Int4LinearMethod)
            assert methods["model.layers.1.mlp.down_proj"] is Int8LinearMethod
            assert not model.model.layers[1].mlp.down_proj.quant_method.symmetric
            assert methods["lm_head.linear"] is Int8LinearMethod
        prompt = random_prompt(3, 40)
        hf = AutoModelForCausalLM.from_pretrained(f"{path}/decompressed", dtype=torch.float32)
        assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf.eval(), prompt)
    finally:
        llm.engine.shutdown()


def _moe_mixed(src: str, dst: str, experts_target: str | None) -> dict[str, torch.Tensor]:
    """`src` (a MoE model) with its dense linears in FP8 per channel (the `Linear` group) and its
    experts, stored per expert, in their own group: INT4 (group 32, symmetric) for `experts_target`,
    or with None left in full precision by `ignore`. Returns the values the quantized tensors hold."""
    from tests.quantization.checkpoints import is_quantized_linear, write_quantized_checkpoint
    from tests.quantization.ct_checkpoints import _int4_tensors
    from tests.quantization.moe_checkpoints import CT_FP8_DYNAMIC, EXPERT, _expert_fp8
    config = json.loads(json.dumps(CT_FP8_DYNAMIC))
    config["format"] = "mixed-precision"
    config["config_groups"]["group_0"]["format"] = "float-quantized"
    if experts_target is None:
        config["ignore"].append("re:.*\\.experts\\..*")
    else:
        config["config_groups"]["experts"] = {"targets": [experts_target], **_int4(32), "format": "pack-quantized"}

    def quantize(base: str, t: torch.Tensor):
        if EXPERT.search(base + ".weight"):
            return _int4_tensors(base, t, 32, True, False)
        return _expert_fp8(base, t, per_channel=True, static=False)
    return write_quantized_checkpoint(src, dst, quantize, config, select=lambda name: (
        experts_target is not None if EXPERT.search(name) else is_quantized_linear(name)))


@pytest.mark.parametrize("arch,experts_target,tp", [
    ("qwen3_moe", "re:.*mlp\\.experts\\..*", 1), ("qwen3_moe", "re:.*mlp\\.experts\\..*", 2),
    ("mixtral", "re:.*block_sparse_moe\\.experts\\..*", 1),   # the checkpoint's names, not the model's mlp.experts
    ("qwen3_moe", None, 1),
])
def test_moe_experts_in_a_scheme_of_their_own_match_hf(tmp_path, arch, experts_target, tp):
    """MoE experts in another config group than the dense linears (INT4 experts beside FP8 attention,
    llm-compressor's mixed recipes for MoE models), or left in full precision by `ignore`: the experts
    take their own method before loading; against HF on the values the checkpoint holds."""
    from shardserve.quantization.compressed_tensors import CtInt4MoEMethod
    from shardserve.quantization.fp8 import Fp8LinearMethod
    from tests.quantization.moe_checkpoints import assert_moe_checkpoint_matches_hf
    src = make_tiny_checkpoint(str(tmp_path / "src"), arch)
    values = _moe_mixed(src, str(tmp_path / "ct"), experts_target)

    def methods(model, experts):
        assert {type(m.quant_method) for m in experts} == {CtInt4MoEMethod if experts_target else type(None)}
        assert type(model.model.layers[0].self_attn.qkv_proj.quant_method) is Fp8LinearMethod
    assert_moe_checkpoint_matches_hf(tmp_path, src, str(tmp_path / "ct"), values, tp, methods, **KW)


def test_experts_take_their_group_where_the_linears_scheme_has_no_expert_method():
    """Linears built in asymmetric INT8 (no expert method): INT4 experts in their own group still
    build; the same experts left in that scheme are refused, naming it."""
    from shardserve.layers.moe import FusedMoE
    from shardserve.models.loader import build_model
    from shardserve.quantization.compressed_tensors import CtInt4MoEMethod
    config = json.loads(tiny_hf_config("qwen3_moe").to_json_string())
    int8 = {"targets": ["Linear"], "weights": dict(num_bits=8, type="int", strategy="channel", symmetric=False),
            "format": "int-quantized"}   # (asymmetric INT8: dense layers only)
    config["quantization_config"] = _config(format="mixed-precision", config_groups={
        "experts": {"targets": ["re:.*experts.*"], **_int4(32), "format": "pack-quantized"}, "rest": int8})
    model = build_model(config, torch.float32, torch.device("cpu"))
    assert {type(m.quant_method) for m in model.modules() if isinstance(m, FusedMoE)} == {CtInt4MoEMethod}
    config["quantization_config"] = _config(format="int-quantized", config_groups={"rest": int8})
    with pytest.raises(ValueError, match=r"compressed-tensors INT8 weights for the experts of a mixture-of-experts"):
        build_model(config, torch.float32, torch.device("cpu"))


def test_experts_placed_later_follow_their_layer_to_its_device():
    """An offloaded layer (layers/cpu_offload.py) is moved to the CPU while the model is built, before
    experts waiting for their scheme get it: their weights then go where the layer went."""
    from shardserve.layers.linear import linear_methods
    from shardserve.layers.moe import FusedMoE
    from shardserve.quantization.config import UnplacedExperts, linear_method_factory, moe_method, resolve_quantization
    int8 = {"targets": ["Linear"], "weights": dict(num_bits=8, type="int", strategy="channel", symmetric=False),
            "format": "int-quantized"}   # (asymmetric INT8: dense layers only)
    config = resolve_quantization(None, {"quantization_config": _config(format="mixed-precision", config_groups={
        "experts": {"targets": ["re:.*experts.*"], **_int4(32), "format": "pack-quantized"}, "rest": int8})})
    with linear_methods(linear_method_factory(config)):
        experts = FusedMoE(4, 2, 64, 32, True, prefix="model.layers.0.mlp.experts")
    assert isinstance(experts.quant_method, UnplacedExperts)
    experts.unplaced = torch.nn.Parameter(torch.empty(0, device="meta"))   # as maybe_offload moves a layer's tensors
    experts.requantize(moe_method(config, experts, config.scheme_for("model.layers.0.mlp.experts.0.up_proj")))
    assert {p.device.type for p in experts.parameters()} == {"meta"} and hasattr(experts, "w13_weight_packed")


def test_mixed_layouts_the_kernels_cannot_hold_are_refused(tmp_path):
    """The parts of a fused layer in different schemes, and the experts of one MoE layer in several
    schemes, are refused while the model is built, naming the layer."""
    from shardserve.models.loader import build_model
    config = json.loads(tiny_hf_config("llama").to_json_string())
    config["quantization_config"] = _config(config_groups={"q": {"targets": ["re:.*q_proj$"], **_int4(32)},
                                                           "rest": {"targets": ["Linear"], **_int4(None)}})
    with pytest.raises(ValueError, match=r"stores in different schemes the fused layer model.layers.0.self_attn.qkv"):
        build_model(config, torch.float32, torch.device("cpu"))
    config = json.loads(tiny_hf_config("qwen3_moe").to_json_string())
    config["quantization_config"] = _config(config_groups={"e0": {"targets": ["re:.*experts\\.0\\..*"], **_int4(32)},
                                                           "rest": {"targets": ["Linear"], **_int4(None)}})
    with pytest.raises(ValueError, match=r"stores the experts of model.layers.0.mlp.experts in several schemes: not"):
        build_model(config, torch.float32, torch.device("cpu"))


def test_layers_take_the_most_specific_target():
    """compressed-tensors' precedence, checked against the library's own `match_targets`: a module
    name, then "re:" patterns (sorted), then the Linear type; a target two groups name takes the later
    group's scheme; a layer no target matches stays full precision, and so does one in `ignore`."""
    from compressed_tensors.utils.match import match_targets
    groups = {"every": {"targets": ["Linear"], **_int4(128)}, "mlp": {"targets": ["re:.*mlp.*"], **_int4(64)},
              "down": {"targets": ["re:.*down_proj$", "model.layers.0.mlp.gate_proj"], **_int4(32)},
              "later": {"targets": ["model.layers.0.mlp.gate_proj"], **_int4(None)}}
    layout = parse(_config(ignore=["lm_head", "model.layers.1.mlp.up_proj"], config_groups=groups))
    scheme_of_target = {t: g for g in groups.values() for t in g["targets"]}   # a later group's wins
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj",
                 "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.up_proj", "lm_head"):
        ours = layout.scheme_for(name)
        if name in ("model.layers.1.mlp.up_proj", "lm_head"):   # in `ignore`
            assert ours is None
            continue
        theirs = scheme_of_target[match_targets(name, torch.nn.Linear(1, 1), scheme_of_target)[0]]["weights"]
        assert (ours.strategy, ours.group_size) == (theirs["strategy"], theirs.get("group_size")), name
    assert layout.scheme_for("model.layers.0.mlp.down_proj").group_size == 32   # "re:.*down_proj$" sorts first
    assert layout.scheme_for("model.layers.0.mlp.gate_proj").strategy == "channel"
    assert layout.default.group_size == 128 and len(layout.schemes) == 4
    only_attention = parse(_config(ignore=[], config_groups={"a": {"targets": ["re:.*self_attn.*"], **_int4(32)}}))
    assert only_attention.scheme_for("model.layers.0.mlp.up_proj") is None
    assert only_attention.scheme_for("lm_head") is None and only_attention.scheme_for("model.layers.0.self_attn.o_proj")
