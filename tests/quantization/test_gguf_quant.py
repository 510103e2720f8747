"""GGUF weights kept in their blocks (quantization/gguf.py, kernels/cpu/quant_ops.py): the kernels
against dequantize-then-matmul for every format on every ISA path this CPU runs, batch invariance,
tiny GGUF files against HF on the file's weights (mixed types per fused layer included), and the
embedded SmolLM2 kept quantized against our dequantized path."""
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


def test_isa_switch(monkeypatch):
    quant_ops._isa_from_env.cache_clear()
    monkeypatch.setenv(quant_ops.ISA_SWITCH, "scalar")
    assert quant_ops.isa() == "scalar"
    monkeypatch.setenv(quant_ops.ISA_SWITCH, "sse9")
    with pytest.raises(ValueError, match="scalar, avx2, avx512"):
        quant_ops.isa()
    quant_ops._isa_from_env.cache_clear()


def _kept_types(llm: LLM) -> dict[str, str | None]:
    model = llm.engine.executor.worker.model_runner.model
    return {name: module.quant_method.type_name for name, module in model.named_modules()
            if isinstance(getattr(module, "quant_method", None), GgufLinearMethod)}


def _typed_add_tensor(original, qtype: str, mixed: bool):
    """Every tensor stored as `qtype` (the writer's file-type metadata knows only F32/F16/Q8_0, so the
    file is written as Q8_0 and the tensors retyped here); with `mixed`, v and up as Q8_0: fused
    q/k/v and gate/up with parts of different types."""
    def add(w, gname, data, qtype_name):
        original(w, gname, data, "Q8_0" if mixed and gname.endswith(("attn_v.weight", "ffn_up.weight")) else qtype)
    return add


@pytest.mark.parametrize("arch,qtype,mixed", [("llama", "Q4_0", False), ("smollm2", "Q4_1", False),
                                              ("llama", "Q8_0", False), ("llama", "Q4_1", True)])
def test_tiny_gguf_kept_quantized_matches_hf(tmp_path, monkeypatch, arch, qtype, mixed):
    monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", "0")
    ckpt_dir = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch)
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
        assert fused == ({None} if mixed else {qtype}), kept   # mixed parts: dequantized
        prompt = random_prompt(5, 40)
        ours = prompt_logprobs(llm, prompt)
    finally:
        llm.engine.shutdown()
    hf = load_hf_model(ckpt_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            kind = "Q8_0" if mixed and name.endswith(("v_proj.weight", "up_proj.weight")) else qtype
            p.copy_(torch.from_numpy(roundtrip(p.detach().numpy().copy(), kind)))
    exact = hf_logprobs(hf, prompt)[:len(prompt) - 1]
    diff = (ours - exact).abs().max().item()
    assert diff <= 1e-4, f"{qtype}: log-probs differ from HF on the same weights by {diff:.2e}"


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PLAIN = "Gravity is the force that"


def _smollm2(monkeypatch, dequantize: bool) -> LLM:
    monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", "1" if dequantize else "0")
    return LLM(default_model_path(), dtype="float32", max_model_len=1024, kv_cache_memory="128MiB",
               show_progress=False)


def test_smollm2_kept_quantized_matches_dequantized(monkeypatch):
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
    """The decoder linears hold Q4_1 blocks: 20 bytes per 32 weights."""
    llm = _smollm2(monkeypatch, False)
    try:
        model = llm.engine.executor.worker.model_runner.model
        kept = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), GgufLinearMethod)]
        assert kept and all(m.weight.dtype == torch.uint8 for m in kept)
        for m in kept:
            assert m.weight.numel() == m.output_size * m.input_size // 32 * 20
    finally:
        llm.engine.shutdown()
