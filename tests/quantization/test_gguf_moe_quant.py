"""GGUF mixture-of-experts weights kept in their blocks on the CPU (quantization/gguf_moe.py,
kernels/moe/gguf_experts.py): the stacked experts of a tiny Qwen3-MoE / Mixtral GGUF stay in blocks
and give HF's log-probs on the file's weights (within the activation rounding), HF's greedy tokens,
fewer bytes than dequantized experts, and, cut over two tensor-parallel ranks or held whole by two
expert-parallel ranks, one rank's tokens."""
from __future__ import annotations

import pytest
import torch

from shardserve.kernels.cpu import quant_ops
from shardserve.kernels.moe.gguf_experts import GgufExperts
from shardserve.layers.moe import FusedMoE
from shardserve.llm import LLM
from shardserve.quantization.gguf_moe import GgufMoEMethod
from shardserve.sampling_params import SamplingParams
from tests.models.gguf_files import (
    hf_logprobs,
    hf_with_roundtripped_weights,
    prompt_logprobs,
    random_prompt,
    write_moe_gguf,
)
from tests.tiny_models import load_hf_model, make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not quant_ops.available(), reason="GGUF CPU kernels unavailable (no C compiler)")

_TOL = {"fp32": 1e-4, "int16": 2e-3}   # as tests/quantization/test_gguf_quant.py's linears


def _experts(llm: LLM) -> list[FusedMoE]:
    model = llm.engine.executor.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _held_bytes(llm: LLM) -> int:
    model = llm.engine.executor.worker.model_runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _moe_file(tmp, arch: str) -> tuple[str, str]:
    ckpt = make_tiny_checkpoint(str(tmp / "ckpt"), arch)
    path = str(tmp / "tiny.gguf")
    write_moe_gguf(ckpt, path, "Q8_0")
    return ckpt, path


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_file(request, tmp_path_factory):
    return _moe_file(tmp_path_factory.mktemp(request.param), request.param)


def _stack(type_name: str, e: int, n: int, k: int, seed: int) -> torch.Tensor:
    """e experts' [n, k] random weights in `type_name` blocks, regrouped for the int8 kernels."""
    import numpy as np

    from tests.models.gguf_files import quantize
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((e, n, k)).astype(np.float32) / np.sqrt(k), type_name)
    rows = torch.from_numpy(np.ascontiguousarray(raw)).view(e, n, -1)
    return torch.stack([quant_ops.repack(rows[i], type_name, k) for i in range(e)])


class _PerExpert(GgufExperts):
    """GgufExperts that never take the one-call kernel (torch_moe's loop over experts instead)."""

    def __init__(self, experts: GgufExperts) -> None:
        super().__init__(experts.blocks, experts.type_name, experts.n, experts.k, experts.isa, experts.act)

    @property
    def one_call(self) -> bool:
        return False


@pytest.mark.parametrize("act", ["int16", "int8"])
@pytest.mark.parametrize("type13,type2", [("Q4_0", "Q8_0"), ("Q4_1", "Q4_1"), ("Q4_K", "Q6_K")])
def test_one_call_per_layer_gives_one_call_per_experts_bits(act, type13, type2):
    """quant_ops.moe_int8 (every pick in one kernel call) against torch_moe's one call per expert:
    the same bits, with picks held elsewhere (-1) skipped and tokens of every pick count."""
    from shardserve.kernels.moe import torch_moe
    e, h, inter, top_k, t = 6, 256, 256, 3, 9
    isa = quant_ops.isa()
    w13 = GgufExperts(_stack(type13, e, 2 * inter, h, 0), type13, 2 * inter, h, isa, act)
    w2 = GgufExperts(_stack(type2, e, h, inter, 1), type2, h, inter, isa, act)
    torch.manual_seed(0)
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(t)])
    ids[2, 1] = ids[5, 0] = -1   # held by another expert-parallel rank
    weights = torch.rand(t, top_k)
    got = torch_moe.fused_moe(x, w13, w2, weights, ids)   # one call: w13 and w2 take the int8 kernels
    # one call per expert: the same stacks seen through plain fields, so the loop runs
    per_expert = torch_moe.fused_moe(x, _PerExpert(w13), _PerExpert(w2), weights, ids)
    assert torch.equal(got, per_expert)
    assert torch.equal(torch_moe.fused_moe(x[4:5], w13, w2, weights[4:5], ids[4:5]), got[4:5])   # alone


@pytest.mark.parametrize("act", ["int16", "fp32"])
def test_experts_kept_in_blocks_match_hf(moe_file, monkeypatch, act):
    ckpt, path = moe_file
    monkeypatch.setenv(quant_ops.ACTIVATIONS_SWITCH, act)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    try:
        experts = _experts(llm)
        assert experts and all(isinstance(m.quant_method, GgufMoEMethod) for m in experts)
        for m in experts:
            assert m.w13_weight.dtype == torch.uint8 and m.w2_weight.dtype == torch.uint8
            assert isinstance(m.quant_method.kept["w13"], GgufExperts)
            assert m.quant_method.kept["w13"].act == act
        prompt = random_prompt(11, 40)
        ours = prompt_logprobs(llm, prompt)
        kept_bytes = _held_bytes(llm)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    finally:
        llm.engine.shutdown()
    hf = hf_with_roundtripped_weights(ckpt, "Q8_0")
    diff = (ours - hf_logprobs(hf, prompt)[:len(prompt) - 1]).abs().max().item()
    assert diff <= _TOL[act], f"log-probs differ from HF on the file's weights by {diff:.2e}"
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == want
    # The same file with the experts dequantized at load holds more bytes.
    monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", "1")
    dense = LLM(path, dtype="float32", kv_cache_memory="16MiB", show_progress=False)
    try:
        assert all(m.w13_weight.dtype == torch.float32 for m in _experts(dense))
        assert _held_bytes(dense) > 2 * kept_bytes
    finally:
        dense.engine.shutdown()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(tensor_parallel_size=2, enable_expert_parallel=True)])
def test_experts_in_blocks_sharded_give_one_ranks_tokens(tmp_path, layout):
    """TP=2 cuts each expert's down inputs in whole blocks (the tiny intermediate of 64: one block of
    32 per rank); EP=2 holds whole experts. (Qwen3-MoE: tiny Mixtral's o_proj has 96 inputs, which
    two ranks cannot split into whole Q8_0 blocks.)"""
    _, path = _moe_file(tmp_path, "qwen3_moe")
    prompt = random_prompt(5, 30)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = []
    for kwargs in (dict(), layout):
        llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", show_progress=False, **kwargs)
        try:
            tokens.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
        finally:
            llm.engine.shutdown()
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("experts", [{"up": "Q4_0"}, {"gate": "F16", "up": "F16", "down": "F16"}])
def test_experts_not_kept_are_dequantized(tmp_path, monkeypatch, experts):
    """Experts the block kernels cannot keep (gate and up of different types; a float type) load as
    float experts, as before, and match HF on the file's weights."""
    from tests.models import gguf_files
    original = gguf_files._add_tensor

    def add(w, gname, data, qtype_name):
        kind = gname.split(".")[-2]   # blk.N.ffn_{gate,up,down}_exps.weight
        part = kind[len("ffn_"):-len("_exps")] if kind.endswith("_exps") else None
        original(w, gname, data, experts.get(part, qtype_name))
    monkeypatch.setattr(gguf_files, "_add_tensor", add)
    ckpt, path = _moe_file(tmp_path, "qwen3_moe")
    monkeypatch.setenv(quant_ops.ACTIVATIONS_SWITCH, "fp32")
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    try:
        for m in _experts(llm):
            assert not m.quant_method.kept and m.w13_weight.dtype == torch.float32
        prompt = random_prompt(3, 30)
        ours = prompt_logprobs(llm, prompt)
    finally:
        llm.engine.shutdown()
    hf = hf_with_roundtripped_weights(ckpt, "Q8_0")
    fresh = load_hf_model(ckpt).state_dict()
    with torch.no_grad():   # the experts as this file holds them (HF stacks gate and up as one tensor)
        for name, p in hf.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                half = p.shape[1] // 2
                for part, rows in (("gate", slice(0, half)), ("up", slice(half, None))):
                    values = fresh[name][:, rows].numpy().copy()
                    p[:, rows] = torch.from_numpy(gguf_files.roundtrip(values, experts.get(part, "Q8_0")))
            elif name.endswith("experts.down_proj"):
                p.copy_(torch.from_numpy(gguf_files.roundtrip(fresh[name].numpy().copy(), experts.get("down", "Q8_0"))))
    diff = (ours - hf_logprobs(hf, prompt)[:len(prompt) - 1]).abs().max().item()
    assert diff <= 1e-4, f"log-probs differ from HF on the file's weights by {diff:.2e}"


def test_bench_roofline_counts_the_experts_as_held(moe_file):
    """`bench`'s roofline reads a GGUF MoE model's routed experts at the bytes their blocks hold
    (the worker's FusedMoE parameters), apart from the dense part, not by parameter count."""
    from shardserve.bench.offline import _limits
    from shardserve.models.loader import load_hf_config
    _, path = moe_file
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", show_progress=False)
    try:
        lim = _limits(llm, load_hf_config(path))
        experts = sum({p.data_ptr(): p.numel() * p.element_size() for m in _experts(llm)
                       for p in m.parameters()}.values())
        assert lim["expert_bytes_per_rank"] == experts > 0
        assert lim["dense_bytes_per_rank"] + experts == lim["weight_bytes_per_rank"] == _held_bytes(llm)
    finally:
        llm.engine.shutdown()
