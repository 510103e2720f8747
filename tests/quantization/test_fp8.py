"""FP8 weights on the CPU path: `--quantization fp8` on a full-precision checkpoint and FP8
checkpoints (per-tensor scales, one per fused part), against HF transformers on the same
FP8-rounded weights; the real SmolLM2 in FP8 still answers and keeps its perplexity."""
from __future__ import annotations

import pytest
import torch

from shardserve.llm import LLM
from shardserve.quantization.fp8 import FP8, quantize_rows
from shardserve.sampling_params import SamplingParams
from tests.models.test_parity import assert_matches_hf, full_logprob_params, random_prompt
from tests.quantization.checkpoints import (
    ENGLISH_TEXT,
    hf_with_weights,
    is_quantized_linear,
    smollm2_hf_checkpoint,
    write_fp8_block_checkpoint,
    write_fp8_checkpoint,
)
from tests.tiny_models import load_hf_model, make_tiny_checkpoint

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
def test_rows_quantize_to_e4m3_with_a_scale_each():
    w = torch.randn(64, 96) * torch.logspace(-2, 1, 64)[:, None]   # rows of very different scales
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.shape == (64,)
    assert q.float().abs().amax(dim=1).sub(448).abs().max() == 0   # every row uses the full range
    rel = ((q.float() * scale[:, None] - w).abs() / w.abs().amax(dim=1, keepdim=True)).max()
    assert rel <= 2 ** -4   # E4M3 keeps 3 mantissa bits


def _fp8_rounded(path: str) -> dict[str, torch.Tensor]:
    hf = load_hf_model(path)
    out = {}
    for name, w in hf.state_dict().items():
        if is_quantized_linear(name):
            q, scale = quantize_rows(w)
            out[name] = q.float() * scale[:, None]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # qwen2: biases on q/k/v
def test_online_fp8_matches_hf_on_the_rounded_weights(tmp_path, arch):
    path = make_tiny_checkpoint(str(tmp_path / arch), arch)
    hf = hf_with_weights(path, _fp8_rounded(path))
    llm = LLM(path, quantization="fp8", kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    prompt = random_prompt(1, 40)
    assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf, prompt)
    llm.engine.shutdown()


@pytest.mark.parametrize("tp,static", [(1, True), (2, True), (1, False)])
def test_fp8_checkpoint_matches_hf_on_its_weights(tmp_path, tp, static):
    """q, k, v (and gate, up) carry different per-tensor scales and live in one fused matrix;
    under TP each rank holds its rows of every part. static False: `activation_scheme: dynamic`,
    no input_scale tensors at all."""
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    dequantized = write_fp8_checkpoint(src, str(tmp_path / "fp8"), static)
    hf = hf_with_weights(src, dequantized)
    llm = LLM(str(tmp_path / "fp8"), kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1,
              tensor_parallel_size=tp)
    prompt = random_prompt(2, 40)
    assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf, prompt)
    llm.engine.shutdown()


FBGEMM_SKIP = ["lm_head", "layers.0.mlp.down_proj", "model.layers.1.self_attn"]


def _fbgemm_skipped(name: str) -> bool:
    """The layers FBGEMM_SKIP leaves in 16 bits, spelled out (a name's tail; layer 1's attention by prefix)."""
    return name.startswith(("model.layers.0.mlp.down_proj.", "model.layers.1.self_attn."))


@pytest.mark.parametrize("tp", [1, 2])
def test_fbgemm_fp8_checkpoint_matches_hf_on_its_weights(tmp_path, tp):
    """Meta's FP8 layout (`quant_method: fbgemm_fp8`): E4M3 weights with an fp32 scale per output
    channel, `modules_to_not_convert` naming layers by a name's tail, by a prefix and the LM head;
    those load as plain layers, the rest FP8."""
    from tests.quantization.checkpoints import write_quantized_checkpoint
    from tests.quantization.moe_checkpoints import _expert_fp8
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    config = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": FBGEMM_SKIP}
    dequantized = write_quantized_checkpoint(
        src, str(tmp_path / "fbgemm"), lambda base, t: _expert_fp8(base, t, per_channel=True, static=False), config,
        select=lambda name: is_quantized_linear(name) and not _fbgemm_skipped(name))
    assert dequantized and not any(_fbgemm_skipped(n) for n in dequantized)
    hf = hf_with_weights(src, dequantized)
    llm = LLM(str(tmp_path / "fbgemm"), kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1,
              tensor_parallel_size=tp)
    try:
        prompt = random_prompt(2, 40)
        assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf, prompt)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("block", [None, (32, 32)])
def test_fp8_checkpoint_with_layers_left_in_16_bits(tmp_path, block):
    """`quant_method: fp8` with AutoFP8's / vLLM's `ignored_layers` (full names; per-tensor scales) or
    transformers' `modules_to_not_convert` (block scales, as Qwen3-*-FP8 write it): those layers load
    plain, against HF on the checkpoint's values."""
    from tests.quantization.checkpoints import _fp8_block_tensors, _fp8_tensors, write_quantized_checkpoint
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block:
        config.update(weight_block_size=list(block), modules_to_not_convert=["lm_head", "layers.0.mlp.down_proj",
                                                                             "model.layers.1.self_attn"])
        tensors = lambda base, t: _fp8_block_tensors(base, t, block)   # noqa: E731
    else:
        config["ignored_layers"] = ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
                                    "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj",
                                    "model.layers.1.self_attn.o_proj"]
        tensors = lambda base, t: _fp8_tensors(base, t, static=False)   # noqa: E731
    values = write_quantized_checkpoint(src, str(tmp_path / "fp8"), tensors, config,
                                        select=lambda name: is_quantized_linear(name) and not _fbgemm_skipped(name))
    llm = LLM(str(tmp_path / "fp8"), kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    try:
        prompt = random_prompt(2, 40)
        assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf_with_weights(src, values), prompt)
    finally:
        llm.engine.shutdown()


def test_fbgemm_skip_rule_is_transformers_one():
    from shardserve.quantization.fp8 import FbgemmFp8Config
    config = FbgemmFp8Config(from_checkpoint=True, skip=("model.layers.1", "mlp.gate", "fc1", "model.layers.2.*attn"))
    assert config.ignores("model.layers.1.self_attn.q_proj") and not config.ignores("model.layers.11.self_attn.q_proj")
    assert config.ignores("model.layers.3.mlp.gate") and not config.ignores("model.layers.3.mlp.gate_proj")
    assert config.ignores("model.decoder.layers.23.fc1") and config.ignores("model.layers.2.self_attn.o_proj")


@pytest.mark.parametrize("block,tp", [((32, 32), 1), ((64, 64), 1), ((32, 16), 2)])
def test_fp8_block_scaled_checkpoint_matches_hf(tmp_path, block, tp):
    """`weight_block_size` (Qwen3-FP8, DeepSeek-V3): the checkpoint's own values q * s (64 x 64
    leaves partial edge blocks on the tiny model's 96- and 192-wide matrices; at TP=2 each rank's
    48 rows of q / o cut a block of 32 rows, and k / v's parts start inside one)."""
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    hf = hf_with_weights(src, write_fp8_block_checkpoint(src, str(tmp_path / "fp8"), block))
    llm = LLM(str(tmp_path / "fp8"), kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1,
              tensor_parallel_size=tp)
    prompt = random_prompt(7, 40)
    assert_matches_hf(llm.generate([prompt], full_logprob_params())[0], hf, prompt)
    llm.engine.shutdown()


def test_fp8_block_scaled_checkpoint_refuses_a_tp_that_cuts_input_blocks(tmp_path):
    """At TP=2, o_proj and down_proj's 96 and 192 inputs give each rank 48 and 96: blocks of 32
    inputs would be cut in two (vLLM refuses these too)."""
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    write_fp8_block_checkpoint(src, str(tmp_path / "fp8"), (32, 32))
    with pytest.raises(Exception, match="not a multiple of the checkpoint's FP8 blocks of 32"):
        LLM(str(tmp_path / "fp8"), kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=2)


def test_bad_quantization_requests_are_clear(tmp_path):
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama")
    write_fp8_checkpoint(src, str(tmp_path / "fp8"))
    with pytest.raises(ValueError, match="not supported; choose one of fp8"):
        LLM(src, quantization="int3")
    import json
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitnet"}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized with 'bitnet', which is not supported"):
        LLM(str(tmp_path / "fp8"))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return smollm2_hf_checkpoint(str(tmp_path_factory.mktemp("smollm2_hf")))


def _perplexity(llm: LLM) -> float:
    out = llm.generate([ENGLISH_TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [row[t].logprob for row, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    return float(torch.tensor(lps).neg().mean().exp())


def test_smollm2_fp8_answers_and_keeps_its_perplexity(smollm2, tmp_path):
    kw = dict(max_model_len=1024, kv_cache_memory="64MiB", show_progress=False)
    full = LLM(smollm2, **kw)
    ppl_full = _perplexity(full)
    full.engine.shutdown()
    write_fp8_checkpoint(smollm2, str(tmp_path / "fp8"))
    for llm in (LLM(smollm2, quantization="fp8", **kw), LLM(str(tmp_path / "fp8"), **kw)):
        text = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
        assert "Paris" in text, text
        ppl = _perplexity(llm)
        assert abs(ppl / ppl_full - 1) <= 0.02, f"FP8 perplexity {ppl:.3f} vs {ppl_full:.3f} in bf16"
        llm.engine.shutdown()


def test_smollm2_fp8_block_checkpoint_keeps_its_values(smollm2, tmp_path):
    """Qwen3-FP8's 128 x 128 blocks on the real SmolLM2 (partial edge blocks: 576 = 4.5 x 128): it
    answers, and its perplexity is that of the 16-bit model holding the same block values (the
    blocks' own rounding costs SmolLM2 ~2%; rounding them again per channel cost 5.6%)."""
    from tests.quantization.moe_checkpoints import write_with_weights
    kw = dict(max_model_len=1024, kv_cache_memory="64MiB", show_progress=False)
    values = write_fp8_block_checkpoint(smollm2, str(tmp_path / "blocks"), (128, 128))
    same = LLM(write_with_weights(smollm2, str(tmp_path / "values"), values), **kw)
    ppl_values = _perplexity(same)
    same.engine.shutdown()
    llm = LLM(str(tmp_path / "blocks"), **kw)
    try:
        text = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
        assert "Paris" in text, text
        ppl = _perplexity(llm)
    finally:
        llm.engine.shutdown()
    assert abs(ppl / ppl_values - 1) <= 0.002, f"block FP8 perplexity {ppl:.3f} vs {ppl_values:.3f} on its values"
