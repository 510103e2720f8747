"""GGUF weights kept in their blocks (quantization/gguf.py, kernels/cpu/quant_ops.py): the kernels
against dequantize-then-matmul for every format on every ISA path this CPU runs (fp32 activations,
and x quantized to one or two int8 levels, checked against the same quantization done in torch),
batch invariance, tiny GGUF files against HF on the file's weights (mixed types per fused layer
included), and the embedded SmolLM2 kept quantized against our dequantized path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve.kernels.cpu import quant_ops
from shardserve.llm import LLM
from shardserve.models.loader import default_model_path
from shardserve.quantization.gguf import GgufLinearMethod
from shardserve.sampling_params import SamplingParams
from tests.models import gguf_files
from tests.models.gguf_files import hf_logprobs, prompt_logprobs, random_prompt, roundtrip, write_gguf
from tests.tiny_models import load_hf_model, make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not quant_ops.available(), reason="GGUF CPU kernels unavailable (no C compiler)")

FORMATS = list(quant_ops.TYPES)


def _weights(type_name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw uint8 blocks [n, row bytes], gguf's own dequantization fp32 [n, k]). Q4_0/Q4_1/Q8_0 come
    from gguf's quantizer; the K-quants (which it cannot write) are random bytes with sane scales."""
    import gguf
    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    else:
        unit, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // unit * nbytes), dtype=np.uint8)
        blocks = raw.reshape(n, k // unit, nbytes)
        scale = np.array([0.01], dtype=np.float16).view(np.uint8)
        if type_name == "Q6_K":
            blocks[:, :, 208:210] = scale
        else:
            blocks[:, :, 0:2] = blocks[:, :, 2:4] = scale
    ref = gguf.quants.dequantize(raw, qtype).reshape(n, k)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(ref)


def _isa_or_skip(isa: str) -> str:
    if isa not in quant_ops.cpu_isas():
        pytest.skip(f"this CPU has no {isa} (runs {', '.join(quant_ops.cpu_isas())})")
    return isa


@pytest.mark.parametrize("isa", quant_ops.ISAS)
@pytest.mark.parametrize("type_name", FORMATS)
def test_kernel_matches_dequantize_then_matmul(type_name, isa):
    _isa_or_skip(isa)
    n, k = 37, 512
    raw, ref = _weights(type_name, n, k)
    assert torch.equal(quant_ops.dequantize(raw, type_name, k), ref)
    bias = torch.randn(n)
    for m in (1, 3, 17):
        x = torch.randn(m, k)
        expected = x.double() @ ref.double().T + bias.double()
        got = quant_ops.linear(x, raw, type_name, bias, isa_name=isa)
        err = ((got.double() - expected).abs().max() / expected.abs().max()).item()
        assert err < 1e-5, f"{type_name} {isa} M={m}: relative error {err:.2e}"
    # Batch invariance: a row's result does not depend on the rows around it.
    x = torch.randn(17, k)
    full = quant_ops.linear(x, raw, type_name, isa_name=isa)
    for start, rows in ((0, 1), (5, 2), (3, 3), (9, 4), (4, 5), (0, 13)):
        part = quant_ops.linear(x[start:start + rows], raw, type_name, isa_name=isa)
        assert torch.equal(part, full[start:start + rows]), f"{type_name} {isa}: rows {start}+{rows} differ"


def _quantized_x(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x as the int8 kernels see it (csrc/quant_dot.c), in float64: per block of 32, q1 = round(x * 127 /
    amax) (ties to even, fp32 arithmetic) times amax / 127; with two levels, the residual rounded in
    steps of amax / (127 * 254) as well."""
    xb = x.view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    some = amax > 0
    q1 = torch.round(xb * torch.where(some, torch.tensor(127.0) / amax, torch.zeros_like(amax)))
    d1 = amax / torch.tensor(127.0)
    if levels == 1:
        return (q1.double() * d1.double()).view_as(x)
    id2 = torch.where(some, torch.tensor(32258.0) / amax, torch.zeros_like(amax))
    q2 = torch.round((xb - q1 * d1) * id2).clamp(-127, 127)
    return ((254 * q1.double() + q2.double()) * (amax / torch.tensor(32258.0)).double()).view_as(x)


# Error against fp32 activations allowed per activation mode, relative to the largest output: the
# rounding of x to 8 bits (1/254 of a block's largest value) or ~16 bits.
_X_ROUNDING = {"int8": 3e-2, "int16": 3e-4}


@pytest.mark.parametrize("act", ["int8", "int16"])
@pytest.mark.parametrize("isa", quant_ops.ISAS)
@pytest.mark.parametrize("type_name", quant_ops.INT8_TYPES)
def test_int8_kernels_match_dequantize_then_matmul(type_name, isa, act):
    _isa_or_skip(isa)
    levels = {"int8": 1, "int16": 2}[act]
    # Rows not a multiple of the 8-row groups; an odd block count (super-blocks for the K-quants).
    shapes = ((37, 512), (16, 768)) if type_name.endswith("_K") else ((37, 512), (16, 96))
    for n, k in shapes:
        raw, ref = _weights(type_name, n, k)
        packed = quant_ops.repack(raw, type_name, k)
        # The file's bytes (+ padding rows); Q4_K / Q5_K's 12 bytes of 6-bit scales and mins as 16 bytes.
        extra = {"Q4_K": 4, "Q5_K": 4}.get(type_name, 0) * (k // 256)
        assert packed.numel() == (n + 7) // 8 * 8 * (raw.shape[1] + extra)
        ids = torch.tensor([[0, n - 1], [8, 3]])
        assert torch.equal(quant_ops.rows(packed, type_name, k, ids, n), ref[ids])   # embedding lookups
        bias = torch.randn(n)
        for m in (1, 3, 6, 17):
            x = torch.randn(m, k) * 4
            x[0, :32] = 0.0   # an all-zero block
            got = quant_ops.linear_int8(x, packed, type_name, n, bias, isa_name=isa, act=act).double()
            same_x = _quantized_x(x, levels) @ ref.double().T + bias.double()
            exact = x.double() @ ref.double().T + bias.double()
            scale = exact.abs().max()
            assert ((got - same_x).abs().max() / scale).item() < 1e-5, f"{type_name} {isa} {act} M={m}"
            assert ((got - exact).abs().max() / scale).item() < _X_ROUNDING[act], f"{type_name} {isa} {act} M={m}"
        x = torch.randn(17, k)
        full = quant_ops.linear_int8(x, packed, type_name, n, isa_name=isa, act=act)
        for start, rows in ((0, 1), (5, 2), (3, 3), (9, 4), (4, 5), (0, 13)):
            part = quant_ops.linear_int8(x[start:start + rows], packed, type_name, n, isa_name=isa, act=act)
            assert torch.equal(part, full[start:start + rows]), f"{type_name} {isa} {act}: rows {start}+{rows} differ"
    with pytest.raises(ValueError, match="does not hold"):
        quant_ops.linear_int8(torch.randn(1, k), packed[:-1].contiguous(), type_name, n)
    with pytest.raises(IndexError):
        quant_ops.rows(packed, type_name, k, torch.tensor([n]), n)


@pytest.mark.parametrize("isa", quant_ops.ISAS)
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_int8_k_quants_at_the_extremes(type_name, isa):
    """Every weight and scale at its largest (Q6_K: -32 times scale -128) against x all at its block's
    largest value: the integer sums at their widest (Q6_K's halves would pass 2^31 summed as one)."""
    _isa_or_skip(isa)
    import gguf
    n, k = 8, 512
    raw, _ = _weights(type_name, n, k)
    blocks = raw.view(n, k // 256, -1)
    if type_name == "Q6_K":
        blocks[:, :, :192] = 0            # q = 0: weight -32
        blocks[:, :, 192:208] = 128       # scale -128
    else:
        blocks[:, :, 4:16] = 255          # every 6-bit scale and min 63
        blocks[:, :, 16:] = 255           # every value at its top (Q5_K: the fifth bits too)
    ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[type_name]).reshape(n, k))
    packed = quant_ops.repack(raw, type_name, k)
    for act, levels in (("int8", 1), ("int16", 2)):
        for x in (torch.full((2, k), 3.0), torch.full((2, k), -3.0)):
            got = quant_ops.linear_int8(x, packed, type_name, n, isa_name=isa, act=act).double()
            same_x = _quantized_x(x, levels) @ ref.double().T
            assert ((got - same_x).abs().max() / same_x.abs().max()).item() < 1e-6, f"{type_name} {isa} {act}"


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("isa", quant_ops.ISAS)
def test_int8_gated_matches_silu_of_the_two_halves(isa, type_name):
    """The merged [gate; up] form: silu(x gate^T) * (x up^T) from one kernel, as the plain kernel's two
    halves give it, for 1 and 5 rows (the MLP's gate_up_proj with quantization/gguf.py's apply_gated)."""
    _isa_or_skip(isa)
    n, k = 32, 256 if type_name.endswith("_K") else 96
    raw, _ = _weights(type_name, n, k)
    packed = quant_ops.repack(raw, type_name, k)
    plain = quant_ops.int8_matmul(packed, type_name, n, k, isa, "int16")
    gated = quant_ops.int8_matmul(packed, type_name, n, k, isa, "int16", gated=True)
    for m in (1, 5):
        x = torch.randn(m, k)
        both = plain(x)
        expected = torch.nn.functional.silu(both[:, :n // 2]) * both[:, n // 2:]
        torch.testing.assert_close(gated(x), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="8-row groups"):
        quant_ops.int8_matmul(quant_ops.repack(raw[:24], type_name, k), type_name, 24, k, isa, "int16", gated=True)


def test_isa_switch(monkeypatch):
    quant_ops._isa_from_env.cache_clear()
    monkeypatch.setenv(quant_ops.ISA_SWITCH, "scalar")
    assert quant_ops.isa() == "scalar"
    monkeypatch.setenv(quant_ops.ISA_SWITCH, "sse9")
    with pytest.raises(ValueError, match="scalar, avx2, avx512, avx512_vnni"):
        quant_ops.isa()
    quant_ops._isa_from_env.cache_clear()
    monkeypatch.setenv(quant_ops.ACTIVATIONS_SWITCH, "int4")
    with pytest.raises(ValueError, match="int16"):
        quant_ops.activations()


@pytest.mark.parametrize("act", ["fp32", "int16"])
def test_fused_layer_of_two_types_keeps_a_run_per_type(monkeypatch, act):
    """q/k in Q4_K and v in Q6_K (a Q4_K_M file's mix) with a bias: each run kept in its blocks as a
    parameter of its own, the output the runs' products in their columns (the same bits as each run
    multiplied alone), and the decoder stack's chain of the same calls (its bias split per part)."""
    from shardserve.layers.linear import QKVParallelLinear, linear_methods, process_weights_after_loading
    from shardserve.quantization.gguf import GgufConfig
    monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", "0")
    monkeypatch.setenv(quant_ops.ACTIVATIONS_SWITCH, act)
    k = 512
    with linear_methods(GgufConfig().linear_method):
        layer = QKVParallelLinear(k, 32, 4, 2, bias=True)   # q 128 rows, k 64, v 64
    parts = {"q": _weights("Q4_K", 128, k, 0), "k": _weights("Q4_K", 64, k, 1), "v": _weights("Q6_K", 64, k, 2)}
    for shard, (raw, _) in parts.items():
        type_name = "Q6_K" if shard == "v" else "Q4_K"
        loaded = raw.view(raw.shape[0], k // 256, -1)
        loaded.gguf_type = type_name
        layer.weight.weight_loader(layer.weight, loaded, shard)
    bias = torch.randn(256)
    layer.bias.data.copy_(bias)
    process_weights_after_loading(layer)
    method = layer.quant_method
    assert method.type_name == "Q4_K+Q6_K" and layer.weight.numel() == 0
    kept = {name: p for name, p in layer.named_parameters() if name.startswith("gguf")}
    assert sorted(kept) == ["gguf0", "gguf1"] and all(p.dtype == torch.uint8 for p in kept.values())
    assert [(r.start, r.stop, t) for r, t, _, _ in method.cpu_runs] == [(0, 192, "Q4_K"), (192, 256, "Q6_K")]
    x = torch.randn(5, k)
    out = layer(x)
    ref = x @ torch.cat([parts[s][1] for s in "qkv"]).T + bias
    torch.testing.assert_close(out, ref, rtol=1e-4 if act == "fp32" else 2e-2, atol=1e-3 if act == "fp32" else 0.1)
    for rows, type_name, weight, matmul in method.cpu_runs:   # each run alone: the same bits
        alone = (quant_ops.linear(x, weight, type_name, bias[rows]) if act == "fp32"
                 else quant_ops.linear_int8(x, weight, type_name, rows.stop - rows.start, bias[rows]))
        assert torch.equal(out[:, rows], alone)
    stack = layer.stack_linear()
    chain = [stack, stack.next.contents]
    assert not stack.next.contents.next
    assert [(p.col, p.n, p.bias) for p in chain] == [(0, 192, layer.bias.data_ptr()),
                                                     (192, 64, layer.bias.data_ptr() + 192 * 4)]
    assert layer.stack_linear(gated=True) is None and method.apply_gated(layer, x) is None


def _kept_types(llm: LLM) -> dict[str, str | None]:
    model = llm.engine.executor.worker.model_runner.model
    return {name: module.quant_method.type_name for name, module in model.named_modules()
            if isinstance(getattr(module, "quant_method", None), GgufLinearMethod)}


def _typed_add_tensor(original, qtype: str, mixed: str | None):
    """Every tensor stored as `qtype` (the writer's file-type metadata knows only F32/F16/Q8_0, so the
    file is written as Q8_0 and the tensors retyped here); with `mixed`, v and up as that type: fused
    q/k/v and gate/up with parts of different types (Q4_K with Q6_K is what Q4_K_M files do)."""
    def add(w, gname, data, qtype_name):
        original(w, gname, data, mixed if mixed and gname.endswith(("attn_v.weight", "ffn_up.weight")) else qtype)
    return add


# Log-prob error against HF on the same weights per activation mode: fp32 exact up to summation
# order; x rounded to ~16 bits; to 8 bits (llama.cpp's numerics), which only a wiring bug exceeds.
_LOGPROB_TOL = {"fp32": 1e-4, "int16": 2e-3, "int8": 0.25}


@pytest.mark.parametrize("act", ["fp32", "int16", "int8"])
@pytest.mark.parametrize("arch,qtype,mixed", [("llama", "Q4_0", None), ("smollm2", "Q4_1", None),
                                              ("llama", "Q8_0", None), ("llama", "Q4_1", "Q8_0"),
                                              ("llama", "Q4_K", None), ("llama", "Q5_K", None),
                                              ("llama", "Q6_K", None), ("llama", "Q4_K", "Q6_K")])
def test_tiny_gguf_kept_quantized_matches_hf(tmp_path, monkeypatch, arch, qtype, mixed, act):
    monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", "0")
    monkeypatch.setenv(quant_ops.ACTIVATIONS_SWITCH, act)
    # The K-quants' super-blocks need every input width a multiple of 256 (embedding and LM head too).
    widths = dict(hidden_size=256, intermediate_size=512) if qtype.endswith("_K") else {}
    ckpt_dir = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch, **widths)
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    monkeypatch.setattr(gguf_files, "_add_tensor", _typed_add_tensor(gguf_files._add_tensor, qtype, mixed))
    write_gguf(ckpt_dir, path, "Q8_0")
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    try:
        assert llm.engine.config.model_config.hf_config["quantization_config"] == {"quant_method": "gguf"}
        kept = _kept_types(llm)
        fused = {t for name, t in kept.items() if name.endswith(("qkv_proj", "gate_up_proj"))}
        others = {t for name, t in kept.items() if name.endswith(("o_proj", "down_proj"))}
        assert others == {qtype}
        # mixed parts: one run of rows per type, each kept in its blocks (q/k then v, gate then up)
        assert fused == ({f"{qtype}+{mixed}"} if mixed else {qtype}), kept
        prompt = random_prompt(5, 40)
        ours = prompt_logprobs(llm, prompt)
    finally:
        llm.engine.shutdown()
    hf = load_hf_model(ckpt_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            kind = mixed if mixed and name.endswith(("v_proj.weight", "up_proj.weight")) else qtype
            p.copy_(torch.from_numpy(roundtrip(p.detach().numpy().copy(), kind)))
    exact = hf_logprobs(hf, prompt)[:len(prompt) - 1]
    diff = (ours - exact).abs().max().item()
    assert diff <= _LOGPROB_TOL[act], f"{qtype} {act}: log-probs differ from HF on the same weights by {diff:.2e}"


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PLAIN = "Gravity is the force that"


def _smollm2(monkeypatch, dequantize: bool) -> LLM:
    monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", "1" if dequantize else "0")
    return LLM(default_model_path(), dtype="float32", max_model_len=1024, kv_cache_memory="128MiB",
               show_progress=False)


@pytest.mark.parametrize("act", ["int16", "fp32"])
def test_smollm2_kept_quantized_matches_dequantized(monkeypatch, act):
    """The same greedy tokens as the dequantized path, with x rounded to ~16 bits (the default) or
    exact. (x rounded to 8 bits, llama.cpp's way, turns the France answer into "L'Étoile, la
    Marseillaise, ..." here, as llama.cpp does on this file: the first token's top two are 0.08 apart.)"""
    monkeypatch.setenv(quant_ops.ACTIVATIONS_SWITCH, act)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    outputs = {}
    for dequantize in (False, True):
        llm = _smollm2(monkeypatch, dequantize)
        try:
            kept = _kept_types(llm)
            assert set(kept.values()) == ({"Q4_1"} if not dequantize else set())
            chat = llm.chat(FRANCE, greedy)[0].outputs[0]
            plain = llm.generate([PLAIN], greedy)[0].outputs[0]
            outputs[dequantize] = (chat.token_ids, plain.token_ids, chat.text)
        finally:
            llm.engine.shutdown()
    assert "Paris" in outputs[False][2], outputs[False][2]
    assert outputs[False][:2] == outputs[True][:2]


def test_smollm2_kept_quantized_weight_memory(monkeypatch):
    """The decoder linears hold Q4_1 blocks (20 bytes per 32 weights) and the tied embedding its Q8_0
    blocks (34 bytes per 32), once for lookups and the LM head: ~0.09 GiB in all."""
    llm = _smollm2(monkeypatch, False)
    try:
        model = llm.engine.executor.worker.model_runner.model
        kept = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), GgufLinearMethod)]
        assert kept and all(m.weight.dtype == torch.uint8 for m in kept)
        for m in kept:
            assert m.weight.numel() == (m.output_size + 7) // 8 * 8 * m.input_size // 32 * 20
        table = model.model.embed_tokens.weight
        assert model.lm_head.weight is table and table.dtype == torch.uint8 and table.gguf_type == "Q8_0"
        assert table.numel() == 49152 * 576 // 32 * 34
        held = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
        assert sum(held.values()) < 0.091 * (1 << 30)
    finally:
        llm.engine.shutdown()
