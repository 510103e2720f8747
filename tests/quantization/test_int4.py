"""GPTQ and AWQ 4-bit checkpoints (and 8-bit GPTQ) on the CPU path: the unpacking against hand-packed
words, tiny models against HF transformers on the same dequantized weights (TP=1 and 2, activation
order), the real SmolLM2 in INT4 (and 8-bit GPTQ) still answering with its perplexity near bf16, and
unsupported variants refused."""
from __future__ import annotations

import json

import pytest
import torch

from shardserve.llm import LLM
from shardserve.models.loader import build_model
from shardserve.quantization.int4 import AWQ_ORDER, AwqConfig, Int4LinearMethod, dequantize, unpack_int4
from shardserve.sampling_params import SamplingParams
from tests.models.test_parity import assert_matches_hf, full_logprob_params, random_prompt
from tests.quantization.checkpoints import (
    ENGLISH_TEXT,
    hf_with_weights,
    is_quantized_linear,
    smollm2_hf_checkpoint,
    write_quantized_checkpoint,
)
from tests.quantization.int4_checkpoints import (
    awq_config,
    pack_int4,
    quantize_rtn,
    quantized_tensors,
    write_int4_checkpoint,
)
from tests.tiny_models import make_tiny_checkpoint, tiny_hf_config

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
KW = dict(kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)


def test_unpacking_known_words():
    word = 0x76543210                 # values 0..7, low nibble first
    word2 = -0x0123456F               # bits 0xFEDCBA91: values 1, 9, 10, ..., 15 (sign bit set)
    values2 = [1, 9, 0xA, 0xB, 0xC, 0xD, 0xE, 0xF]
    packed = torch.tensor([[word, word2]], dtype=torch.int32)
    assert unpack_int4(packed, 1).tolist() == [list(range(8)) + values2]
    assert unpack_int4(packed.t().contiguous(), 0).t().tolist() == [list(range(8)) + values2]   # GPTQ: along K
    # AWQ: nibble i holds output AWQ_ORDER[i], so nibbles 0..7 = 0, 2, 4, 6, 1, 3, 5, 7 give outputs 0..7.
    awq_word = sum(AWQ_ORDER[i] << (4 * i) for i in range(8))
    assert unpack_int4(torch.tensor([[awq_word]], dtype=torch.int32), 1, interleaved=True).tolist() == [list(range(8))]
    # The test writer's packing is the reader's inverse, in both orders and along both dims.
    values = torch.randint(0, 16, (16, 24))
    assert torch.equal(unpack_int4(pack_int4(values, 0), 0), values.int())
    assert torch.equal(unpack_int4(pack_int4(values, 1, awq_order=True), 1, interleaved=True), values.int())
    # 8-bit GPTQ: four bytes a word, low byte first.
    assert unpack_int4(torch.tensor([[0x04030201, -0x01]], dtype=torch.int32), 1, bits=8).tolist() == \
        [[1, 2, 3, 4, 255, 255, 255, 255]]
    values = torch.randint(0, 256, (16, 24))
    assert torch.equal(unpack_int4(pack_int4(values, 0, bits=8), 0, bits=8), values.int())


def test_dequantize_known_groups():
    q = torch.tensor([[0, 15], [3, 4], [8, 8], [15, 0]], dtype=torch.int32)         # [K=4, N=2]
    zeros = torch.tensor([[8, 0], [1, 15]], dtype=torch.int32)                       # [groups=2, N]
    scales = torch.tensor([[0.5, 1.0], [2.0, 0.25]])
    w = dequantize(q, zeros, scales, torch.tensor([0, 0, 1, 1]), torch.float32)     # [N, K]
    assert w.tolist() == [[-4.0, -2.5, 14.0, 28.0], [15.0, 4.0, -1.75, -3.75]]
    w = dequantize(q, zeros, scales, torch.tensor([1, 0, 0, 1]), torch.float32)     # activation order
    assert w.tolist() == [[-2.0, -2.5, 0.0, 28.0], [0.0, 4.0, 8.0, -3.75]]


def test_rtn_quantization_error_is_bounded():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    q, zeros, scales, dq = quantize_rtn(w, torch.arange(96) // 32)
    assert q.shape == (96, 64) and zeros.shape == scales.shape == (3, 64)
    step = scales.float().repeat_interleave(32, dim=0).t()
    err = (dq - w).abs() / step   # half a step, plus up to half more at a group's ends (the integer zero)
    assert err.max() <= 1 and err.mean() < 0.3


@pytest.mark.parametrize("fmt,tp,desc_act,sym,bits", [
    ("gptq", 1, False, True, 4),    # the Hub's usual GPTQ: symmetric, every stored zero 7 (v1) meaning 8
    ("gptq_v2", 1, False, False, 4),
    ("awq", 1, False, False, 4),
    ("gptq", 2, True, False, 4),
    ("awq", 2, False, False, 4),
    ("gptq", 1, False, True, 8),    # Qwen's GPTQ-Int8: symmetric, stored zero 127 (v1) meaning 128
    ("gptq", 2, True, False, 8),
])
def test_int4_checkpoint_matches_hf_on_its_weights(tmp_path, fmt, tp, desc_act, sym, bits):
    """Group 32 (the tiny models have 96 and 192 inputs). Under TP=2 o_proj's 48 inputs per rank
    split a group, so each rank holds every group's scales there, and its own groups in down_proj;
    with desc_act every row-parallel rank picks its inputs' groups through g_idx. 8-bit GPTQ: four
    values a word, dequantized after loading."""
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    dequantized = write_int4_checkpoint(src, str(tmp_path / fmt), fmt, 32, desc_act=desc_act, sym=sym, bits=bits)
    hf = hf_with_weights(src, dequantized)
    llm = LLM(str(tmp_path / fmt), tensor_parallel_size=tp, **KW)
    prompt = random_prompt(3, 40)
    assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf, prompt)
    llm.engine.shutdown()


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_packed_path_matches_hf(tmp_path, monkeypatch, fmt):
    """The path CUDA takes (packed weights kept, dequantized inside every matmul), forced on the CPU."""
    monkeypatch.setattr(Int4LinearMethod, "_keep_packed", staticmethod(lambda qweight: True))
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    hf = hf_with_weights(src, write_int4_checkpoint(src, str(tmp_path / fmt), fmt, 32, desc_act=fmt == "gptq"))
    llm = LLM(str(tmp_path / fmt), **KW)
    layer = llm.engine.executor.worker.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.qweight.dtype == torch.int32 and getattr(layer, "weight", None) is None
    prompt = random_prompt(5, 40)
    assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf, prompt)
    llm.engine.shutdown()


def test_qwen2_biases_and_uneven_groups(tmp_path):
    """q/k/v biases beside the INT4 weights, and GPTQ's shorter last group (K=96, group 64)."""
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen2")
    dequantized = write_int4_checkpoint(src, str(tmp_path / "gptq"), "gptq", 64)
    hf = hf_with_weights(src, dequantized)
    llm = LLM(str(tmp_path / "gptq"), **KW)
    prompt = random_prompt(4, 30)
    assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf, prompt)
    llm.engine.shutdown()


AWQ_LEFT_OUT = ["model.layers.0.self_attn", "down_proj"]   # a module and what it holds; a suffix


@pytest.mark.parametrize("tp", [1, 2])
def test_awq_layers_left_out_load_in_full_precision(tmp_path, tp):
    """AWQ's `modules_to_not_convert` (transformers' rule): the layers it names are stored as plain
    weights and run unquantized, beside INT4 ones; against HF on the same weights."""
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    stored_plain = lambda n: n.startswith("model.layers.0.self_attn.") or ".down_proj." in n   # noqa: E731
    dequantized = write_quantized_checkpoint(
        src, str(tmp_path / "awq"), lambda base, t: quantized_tensors("awq", base, t, 32),
        {**awq_config(32), "modules_to_not_convert": AWQ_LEFT_OUT},
        select=lambda n: is_quantized_linear(n) and not stored_plain(n))
    llm = LLM(str(tmp_path / "awq"), tensor_parallel_size=tp, **KW)
    try:
        if tp == 1:
            layers = llm.engine.executor.worker.model_runner.model.model.layers
            assert layers[0].self_attn.qkv_proj.quant_method is None and layers[1].mlp.down_proj.quant_method is None
            assert isinstance(layers[1].self_attn.qkv_proj.quant_method, Int4LinearMethod)
            assert isinstance(layers[0].mlp.gate_up_proj.quant_method, Int4LinearMethod)
        prompt = random_prompt(3, 40)
        assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf_with_weights(src, dequantized), prompt)
    finally:
        llm.engine.shutdown()


def test_awq_left_out_rule_and_fused_parts():
    config = AwqConfig.from_quantization_config({**awq_config(128), "modules_to_not_convert": ["gate", "layers.1"]})
    assert config.ignores("model.layers.0.mlp.gate") and not config.ignores("model.layers.0.mlp.gate_proj")
    assert not config.ignores("model.layers.1.mlp.up_proj")   # a prefix matches from the name's start only
    with pytest.raises(ValueError, match=r"modules_to_not_convert entry '\(gate' is not a regular expression"):
        AwqConfig.from_quantization_config({**awq_config(128), "modules_to_not_convert": ["(gate"]})
    assert AwqConfig.from_quantization_config({**awq_config(128), "modules_to_not_convert": [r"model\.layers\.1"]}
                                              ).ignores("model.layers.1.mlp.up_proj")
    hf_config = json.loads(tiny_hf_config("llama").to_json_string())
    hf_config["quantization_config"] = {**awq_config(32), "modules_to_not_convert": ["k_proj"]}
    with pytest.raises(ValueError, match=r"leaves \['model.layers.0.self_attn.k_proj'\] in full precision but not"):
        build_model(hf_config, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("tp,packed", [(1, False), (1, True), (2, False)])
def test_gptq_quantized_lm_head_matches_hf(tmp_path, monkeypatch, tp, packed):
    """GPTQ's `lm_head: true`: the head is an INT4 layer too (column-parallel over the vocabulary,
    no dense table), dequantized after loading on the CPU, or kept packed as CUDA keeps it (forced)."""
    if packed:
        monkeypatch.setattr(Int4LinearMethod, "_keep_packed", staticmethod(lambda qweight: True))
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    dequantized = write_int4_checkpoint(src, str(tmp_path / "gptq"), "gptq", 32, lm_head=True)
    assert "lm_head.weight" in dequantized
    hf = hf_with_weights(src, dequantized)
    llm = LLM(str(tmp_path / "gptq"), tensor_parallel_size=tp, **KW)
    if tp == 1:
        head = llm.engine.executor.worker.model_runner.model.lm_head
        assert head.weight is None and isinstance(head.linear.quant_method, Int4LinearMethod)
        assert (getattr(head.linear, "qweight", None) is not None) == packed   # else dequantized after loading
    prompt = random_prompt(6, 40)
    assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf, prompt)
    llm.engine.shutdown()


@pytest.mark.parametrize("native_half", ["0", "1"])
def test_gptq_quantized_lm_head_in_bf16_on_both_cpu_paths(tmp_path, monkeypatch, native_half):
    """bf16 weights with fp32 math or native half-precision math (the switch forces the path the CPU
    would not take): the dequantized head is packed for the native kernel where it is built, as a
    dense head is, and the log-probs stay within bf16's error of the fp32 model's."""
    from shardserve.kernels.cpu import cpu_ops
    from tests.models.test_parity import logprob_matrix
    packed_dims = 3 if cpu_ops.available() else 2   # panels for the native kernel, else the plain matrix
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    write_int4_checkpoint(src, str(tmp_path / "gptq"), "gptq", 32, lm_head=True)
    prompt = random_prompt(8, 40)
    got = {}
    for dtype in ("float32", "bfloat16"):
        monkeypatch.setenv("SHARDSERVE_CPU_NATIVE_HALF", native_half)
        llm = LLM(str(tmp_path / "gptq"), dtype=dtype, **KW)
        try:
            head = llm.engine.executor.worker.model_runner.model.lm_head
            assert head.weight is None and head.linear.weight.dim() == packed_dims
            out = llm.generate([prompt], full_logprob_params(max_tokens=1))[0]
            got[dtype] = logprob_matrix(out.prompt_logprobs[1:])
        finally:
            llm.engine.shutdown()
    assert (got["bfloat16"] - got["float32"]).abs().max().item() < 0.1


def test_gptq_quantized_lm_head_tied_to_the_embedding_is_refused(tmp_path):
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen2")   # tie_word_embeddings: true
    write_int4_checkpoint(src, str(tmp_path / "gptq"), "gptq", 32, lm_head=True)
    with pytest.raises(ValueError, match="quantizes the LM head .* but ties it"):
        LLM(str(tmp_path / "gptq"), **KW)


@pytest.mark.parametrize("fmt,override,message", [
    ("gptq", {"bits": 3}, r"quantization_config.bits=3 are not supported; only 4-bit and 8-bit ones are"),
    ("gptq", {"checkpoint_format": "marlin"}, r"checkpoint_format='marlin' is not supported"),
    ("awq", {"version": "gemv"}, r"version='gemv' is not supported; only 'gemm'"),
    ("awq", {"bits": 8}, r"quantization_config.bits=8 are not supported; only 4-bit ones are"),
    ("awq", {"zero_point": False}, r"zero_point=false"),
])
def test_unsupported_int4_checkpoints_are_refused(tmp_path, fmt, override, message):
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    write_int4_checkpoint(src, str(tmp_path / fmt), fmt, 32)
    with open(tmp_path / fmt / "config.json") as f:
        config = json.load(f)
    config["quantization_config"].update(override)
    with open(tmp_path / fmt / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / fmt), **KW)


def test_8bit_gptq_experts_are_refused(tmp_path):
    """8-bit GPTQ linears are dequantized at load; MoE experts have no 8-bit method: refused while the
    model is built, naming the layer."""
    path = make_tiny_checkpoint(str(tmp_path / "moe"), "qwen3_moe")
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False,
                                     "sym": True, "checkpoint_format": "gptq"}
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"8-bit GPTQ weights for the experts .* are not supported"):
        LLM(path, **KW)


def test_fused_parts_with_different_orders_are_refused(tmp_path):
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    write_int4_checkpoint(src, str(tmp_path / "gptq"), "gptq", 32, desc_act=True)
    from safetensors.torch import load_file, save_file
    path = tmp_path / "gptq" / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, path)
    with pytest.raises(ValueError, match="g_idx of part '[qkv]' differs from the other fused parts"):
        LLM(str(tmp_path / "gptq"), **KW)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = smollm2_hf_checkpoint(str(tmp_path_factory.mktemp("smollm2_hf")))
    with open(f"{path}/config.json") as f:
        assert json.load(f)["hidden_size"] == 576
    return path


def _perplexity(llm: LLM) -> float:
    out = llm.generate([ENGLISH_TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [row[t].logprob for row, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    return float(torch.tensor(lps).neg().mean().exp())


def test_smollm2_int4_answers_and_keeps_its_perplexity(smollm2, tmp_path):
    """Group 64: the 576 inputs are 4.5 groups of 128 (which AutoAWQ refuses; AutoGPTQ makes a short last
    group, and with this calibration-free rounding group 128 costs 16% perplexity). The two formats
    decode to the same values, so the same perplexity (+6.5%); each is read through its own layout.
    8-bit GPTQ (group 128, symmetric, as Qwen's GPTQ-Int8) within 1%."""
    kw = dict(max_model_len=1024, kv_cache_memory="64MiB", show_progress=False)
    full = LLM(smollm2, **kw)
    ppl_full = _perplexity(full)
    full.engine.shutdown()
    for fmt, group, bits, bound in (("gptq", 64, 4, 0.08), ("awq", 64, 4, 0.08), ("gptq", 128, 8, 0.01)):
        path = str(tmp_path / f"{fmt}{bits}")
        write_int4_checkpoint(smollm2, path, fmt, group, sym=bits == 8, bits=bits)
        llm = LLM(path, **kw)
        text = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
        ppl = _perplexity(llm)
        llm.engine.shutdown()
        print(f"{fmt} {bits}-bit group {group}: perplexity {ppl:.3f} vs {ppl_full:.3f} in bf16; {text!r}")
        assert "Paris" in text, text
        assert abs(ppl / ppl_full - 1) <= bound, f"{fmt} perplexity {ppl:.3f} vs {ppl_full:.3f} in bf16"


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_int4_layer_on_cuda_keeps_packed_weights_and_replays_in_a_graph(fmt):
    from shardserve.layers.linear import MergedColumnParallelLinear, linear_methods, process_weights_after_loading
    from shardserve.quantization.int4 import AwqConfig, GptqConfig
    from tests.quantization.int4_checkpoints import awq_config, gptq_config, quantized_tensors
    config = (GptqConfig.from_quantization_config(gptq_config(64)) if fmt == "gptq"
              else AwqConfig.from_quantization_config(awq_config(64)))
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"), linear_methods(config.linear_method):
            layer = MergedColumnParallelLinear(256, [384, 384])
    finally:
        torch.set_default_dtype(torch.float32)
    params, full = dict(layer.named_parameters()), []
    for part in range(2):
        torch.manual_seed(part)
        tensors, dequantized = quantized_tensors(fmt, "x", torch.randn(384, 256) * 0.05, 64)
        for name, t in tensors.items():
            param = params[name[2:]]
            param.weight_loader(param, t.to(param.dtype), part)
        full.append(dequantized)
    process_weights_after_loading(layer)
    assert layer.qweight.dtype == torch.int32 and not hasattr(layer, "weight")
    w = torch.cat(full).cuda()
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ w.to(torch.bfloat16).float().t()
    torch.testing.assert_close(layer(x).float(), expected, atol=2e-2 * expected.abs().max().item(), rtol=2e-2)
    graph, static_x = torch.cuda.CUDAGraph(), x.clone()
    layer(static_x)
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    static_x.copy_(x * 2)
    graph.replay()
    torch.testing.assert_close(static_out, layer(x * 2))


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("fmt,lm_head,bits", [("gptq", False, 4), ("awq", False, 4), ("gptq", True, 4),
                                             ("gptq", True, 8)])
def test_int4_model_on_cuda_tracks_hf(tmp_path, fmt, lm_head, bits):
    """bf16 on the GPU with CUDA graphs, against HF in fp32 on the dequantized weights (lm_head: GPTQ's
    quantized LM head, on the INT4 kernels too; 8-bit GPTQ dequantized at load, the head too)."""
    import gc

    from tests.models.test_parity import hf_logprobs, logprob_matrix
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama", hidden_size=256, intermediate_size=512)
    hf = hf_with_weights(src, write_int4_checkpoint(src, str(tmp_path / fmt), fmt, 64, desc_act=fmt == "gptq",
                                                    lm_head=lm_head, bits=bits))
    llm = LLM(str(tmp_path / fmt), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, show_progress=False,
              max_logprobs=-1)
    try:
        prompt = random_prompt(1, 40)
        out = llm.generate([prompt], full_logprob_params(max_tokens=8), use_tqdm=False)[0]
        ids = prompt + list(out.outputs[0].token_ids)
        ref = hf_logprobs(hf, ids)
        ours = torch.cat([logprob_matrix(out.prompt_logprobs[1:]), logprob_matrix(out.outputs[0].logprobs)])
        diff = (ours - ref[:len(ids) - 1]).abs().max()
        # bf16 against fp32, max over the whole vocabulary: on an H100 0.101 (gptq) and 0.117 (awq) with the
        # W4A16 kernels, under 0.1 with SHARDSERVE_QUANT_KERNELS=0; the kernels match their fp32 reference
        # within bf16 rounding (tests/gpu/test_cuda_quant_kernels.py)
        assert diff < 0.15, f"INT4 log-probs on CUDA are {diff:.3f} away from HF on the dequantized weights"
        runner = llm.engine.executor.worker.model_runner
        qkv, held = runner.model.model.layers[0].self_attn.qkv_proj, "qweight" if bits == 4 else "weight"
        kept = torch.int32 if bits == 4 else torch.bfloat16   # (8-bit: dequantized after loading)
        assert getattr(qkv, held).dtype == kept and runner.wants_graphs()
        if lm_head:
            assert runner.model.lm_head.weight is None and getattr(runner.model.lm_head.linear, held).dtype == kept
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
