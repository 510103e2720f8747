"""Parameter counts, weight bytes and KV bytes of catalog models against numbers worked out by
hand from their published config.json (and the seed numbers of issue 7)."""
from __future__ import annotations

import math

import pytest

from shardserve.bench.shapes import SHAPES, param_counts
from shardserve.planner.catalog import MODELS, catalog_key, model_config
from shardserve.planner.memory import WEIGHT_BYTES, ModelShape, config_dtype

GiB, KiB = 2**30, 2**10


def test_llama_3_1_70b_seed_numbers():
    m = ModelShape(model_config("llama-3.1-70b"))
    h, layers, vocab = 8192, 80, 128256
    attn = h * (64 + 2 * 8) * 128 + 64 * 128 * h          # q, k, v, o
    per_layer = attn + 3 * h * 28672 + 2 * h               # + gate/up/down + two RMSNorms
    total = layers * per_layer + 2 * vocab * h + h         # + embeddings, LM head, final norm
    assert total == 70_553_706_496
    assert m.param_counts()["total"] == total == m.param_counts()["active"]
    weights = m.weight_bytes("bf16", 1, range(layers), True, True)
    assert weights == 2 * total and round(weights / 1e9, 1) == 141.1             # "~140 GB"
    assert m.kv_bytes_per_token("bf16") == 2 * 8 * 128 * 2 * 80 == 320 * KiB     # "~320 KB per token"
    assert m.kv_bytes_per_token("bf16") * 131072 == 40 * GiB                      # "~40 GB per 128K request"
    assert m.kv_bytes_per_token("fp8") == 160 * KiB


def test_llama_3_1_405b_and_8b():
    big = ModelShape(model_config("llama-3.1-405b"))
    assert big.param_counts()["total"] / 1e9 == pytest.approx(405.85, abs=0.01)
    assert round(big.weight_bytes("bf16", 1, range(126), True, True) / 1e9) == 812     # "~810 GB"
    small = ModelShape(model_config("Meta-Llama-3.1-8B-Instruct"))                       # HF-style names resolve
    assert small.param_counts()["total"] == 8_030_261_248
    assert small.kv_bytes_per_token("bf16") == 128 * KiB


def test_weight_bytes_per_rank_splits_layers_and_vocab():
    m = ModelShape(model_config("llama-3.1-70b"))
    h, layers, vocab = 8192, 80, 128256
    per_layer = 855_654_400
    # TP=2: everything splits in half except the RMSNorms; the vocabulary splits into padded halves.
    tp2 = (layers * (per_layer - 2 * h) / 2 + layers * 2 * h + 2 * math.ceil(vocab / 2) * h + h) * 2
    assert m.weight_bytes("bf16", 2, range(80), True, True) == pytest.approx(tp2)
    # PP=2, stage 0: 40 layers + embeddings; stage 1: 40 layers + final norm + LM head.
    assert m.weight_bytes("bf16", 1, range(0, 40), True, False) == (40 * per_layer + vocab * h) * 2
    assert m.weight_bytes("bf16", 1, range(40, 80), False, True) == (40 * per_layer + vocab * h + h) * 2
    # A decode step reads the LM head but only looks rows up in the embedding table.
    assert m.weight_bytes("bf16", 1, range(80), True, True, batch=1) == (80 * per_layer + vocab * h + h) * 2


def test_quantized_weights_keep_embeddings_16_bit():
    m = ModelShape(model_config("llama-3.1-70b"))
    linear = 80 * (855_654_400 - 2 * 8192)
    rest = 80 * 2 * 8192 + 2 * 128256 * 8192 + 8192
    assert m.weight_bytes("fp8", 1, range(80), True, True) == pytest.approx(linear * 1 + rest * 2)
    assert m.weight_bytes("int4", 1, range(80), True, True) == pytest.approx(linear * (0.5 + 3 / 128) + rest * 2)
    assert round(m.weight_bytes("int4", 1, range(80), True, True) / 1e9, 1) == 40.0


def test_gptq_quantized_lm_head_is_held_like_the_linears():
    """GPTQ's lm_head: true: the head at INT4's bytes, the embedding still 16-bit."""
    config = model_config("llama-3.1-70b")
    plain = ModelShape({**config, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    head = ModelShape({**config, "quantization_config": {"quant_method": "gptq", "bits": 4, "lm_head": True}})
    saved = 128256 * 8192 * (2 - (0.5 + 3 / 128))
    assert plain.weight_bytes("int4", 1, range(80), True, True) - head.weight_bytes("int4", 1, range(80), True, True) \
        == pytest.approx(saved)
    assert plain.weight_bytes("int4", 1, range(80), True, False) == head.weight_bytes("int4", 1, range(80), True, False)


def _compressed_tensors(weights: dict, ignore: list[str]) -> dict:
    return {"quant_method": "compressed-tensors", "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


def test_compressed_tensors_checkpoints_say_their_dtype_and_head():
    """llm-compressor's configs carry no top-level bits: the scheme's weights say FP8, INT4, INT8 or
    FP4 (group-scaled INT8 is widened at load: 16 bits), and a head `ignore` leaves out is held like
    the linears."""
    config = model_config("llama-3.1-70b")
    fp8 = _compressed_tensors({"type": "float", "num_bits": 8, "strategy": "channel"}, ["lm_head"])
    w4 = _compressed_tensors({"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}, [])
    assert config_dtype({**config, "quantization_config": fp8}) == "fp8"
    assert config_dtype({**config, "quantization_config": w4}) == "int4"
    w8 = _compressed_tensors({"type": "int", "num_bits": 8, "strategy": "channel"}, ["lm_head"])
    assert config_dtype({**config, "quantization_config": w8}) == "int8"
    w8_groups = _compressed_tensors({"type": "int", "num_bits": 8, "strategy": "group", "group_size": 128}, [])
    assert config_dtype({**config, "quantization_config": w8_groups}) == "bf16"   # widened at load
    modelopt = {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}}   # hf_quant_config.json's
    assert config_dtype({**config, "quantization_config": modelopt}) == "fp8"
    nvfp4 = _compressed_tensors({"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16}, [])
    nvfp4_modelopt = {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}
    for fp4 in (nvfp4, nvfp4_modelopt):   # dequantized at load, unless SHARDSERVE_FP4_KERNELS=1 keeps them 4-bit
        assert config_dtype({**config, "quantization_config": fp4}) == "bf16"
        with pytest.MonkeyPatch.context() as env:
            env.setenv("SHARDSERVE_FP4_KERNELS", "1")
            assert config_dtype({**config, "quantization_config": fp4}) == "fp4"
    assert config_dtype({**config, "quantization_config": {"quant_method": "gptq", "bits": 8}}) == "bf16"   # the same
    assert not ModelShape({**config, "quantization_config": fp8}).head_quantized
    assert ModelShape({**config, "quantization_config": w4}).head_quantized
    assert not ModelShape({**config, "quantization_config": {**w4, "ignore": ["re:.*lm_head$"]}}).head_quantized


def test_layers_in_several_schemes_plan_at_the_widest():
    """Mixed-precision configs (compressed-tensors groups, GPTQ's `dynamic`) plan at their widest scheme,
    never below what the engine holds (8-bit GPTQ layers are dequantized at load); a compressed-tensors
    head is held quantized only where a group targets it."""
    config = model_config("llama-3.1-8b")
    int4 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}
    fp8 = {"type": "float", "num_bits": 8, "strategy": "channel"}
    mixed = {"quant_method": "compressed-tensors", "ignore": [], "config_groups": {
        "attention": {"targets": ["re:.*self_attn.*"], "weights": fp8},
        "mlp": {"targets": ["re:.*mlp.*"], "weights": int4}}}
    assert config_dtype({**config, "quantization_config": mixed}) == "fp8"
    assert not ModelShape({**config, "quantization_config": mixed}).head_quantized   # no group targets it
    mixed["config_groups"]["rest"] = {"targets": ["Linear"], "weights": {**int4, "num_bits": 8, "type": "int",
                                                                         "strategy": "group"}}   # widened at load
    assert config_dtype({**config, "quantization_config": mixed}) == "bf16"
    assert ModelShape({**config, "quantization_config": mixed}).head_quantized
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert config_dtype({**config, "quantization_config": {**gptq, "dynamic": {"-:.*layers\\.0\\.": {}}}}) == "int4"
    assert config_dtype({**config, "quantization_config": {**gptq, "dynamic": {".*down_proj": {"bits": 8}}}}) == "bf16"


def test_int8_experts_count_16_bits():
    """INT8 experts are widened at load on GPUs: at `int8` a MoE model's experts count 2 bytes a weight,
    its other linears 1; a dense model's linears 1."""
    moe, dense = ModelShape(model_config("qwen3-30b-a3b")), ModelShape(model_config("llama-3.1-8b"))

    def size(m: ModelShape, dtype: str) -> float:
        return m.weight_bytes(dtype, 1, range(m.layers), True, True)
    experts = moe.experts * 3 * moe.hidden * moe.moe_intermediate * moe.layers
    assert size(moe, "int8") - size(moe, "fp8") == pytest.approx(experts)
    assert size(dense, "int8") == pytest.approx(size(dense, "fp8"))


def test_moe_total_and_active_qwen3_30b_a3b():
    m = ModelShape(model_config("qwen3-30b-a3b"))
    h = 2048
    attn = h * (32 + 2 * 4) * 128 + 32 * 128 * h + 2 * 128     # + per-head q/k norms
    experts = 128 * 3 * h * 768
    layer = attn + 2 * h + experts + 128 * h                   # + norms, experts, router
    embed = 151936 * h
    counts = m.param_counts()
    assert counts["total"] == 48 * layer + 2 * embed + h == 30_532_122_624
    assert counts["active"] == 48 * (layer - experts + experts * 8 // 128) + 2 * embed + h == 3_353_032_704
    assert m.kv_bytes_per_token("bf16") == 2 * 4 * 128 * 2 * 48
    # Decode at batch 1 reads 8 of 128 experts; at a large batch nearly all of them.
    one = m.weight_bytes("bf16", 1, range(48), True, True, batch=1)
    assert one == pytest.approx(2 * (48 * (layer - experts + experts * 8 / 128) + embed + h))
    assert m.weight_bytes("bf16", 1, range(48), True, True, batch=256) > 0.99 * 2 * (48 * layer + embed + h)


def test_mixtral_and_qwen3_235b_match_published_sizes():
    mix = ModelShape(model_config("mixtral-8x7b")).param_counts()
    assert (mix["total"] / 1e9, mix["active"] / 1e9) == pytest.approx((46.70, 12.88), abs=0.01)
    big = ModelShape(model_config("qwen3-235b-a22b")).param_counts()
    assert (big["total"] / 1e9, big["active"] / 1e9) == pytest.approx((235.09, 22.19), abs=0.01)


def test_deepseek_v3_mla_and_moe():
    cfg = model_config("deepseek-ai/DeepSeek-V3")
    m = ModelShape(cfg)
    assert m.mla and m.experts == 256 and m.moe_layers.count(True) == 58     # first 3 layers dense
    counts = m.param_counts()
    assert counts["total"] / 1e9 == pytest.approx(671.0, abs=0.1)             # without the MTP layer
    assert counts["active"] / 1e9 == pytest.approx(37.5, abs=0.1)
    # MLA caches the latent plus the rotary key per layer, for every TP rank alike.
    assert m.kv_bytes_per_token("bf16") == (512 + 64) * 2 * 61 == 70272
    assert m.kv_bytes_per_token_layer("bf16", tp=8) == m.kv_bytes_per_token_layer("bf16", tp=1)
    assert config_dtype(cfg) == "fp8"                                         # the published weights
    assert m.tp_problem(8) is None and m.tp_problem(3) is not None


def test_gqa_kv_heads_replicate_when_tp_exceeds_them():
    m = ModelShape(model_config("llama-3.1-70b"))                 # 8 KV heads
    assert m.kv_bytes_per_token_layer("bf16", tp=4) == 2 * 2 * 128 * 2
    assert m.kv_bytes_per_token_layer("bf16", tp=16) == 2 * 1 * 128 * 2   # one (replicated) head per rank
    assert m.tp_problem(16) is None                                 # 16 % 8 == 0: vLLM-style replication
    assert "KV heads" in ModelShape(dict(model_config("llama-3.1-70b"), num_key_value_heads=6)).tp_problem(4)
    assert "attention heads" in m.tp_problem(3)


def test_bench_shapes_come_from_the_catalog():
    assert {"llama-3-8b", "llama-3-70b", "qwen3-0.6b", "qwen3-8b"} <= set(SHAPES)
    assert all(SHAPES[n] is MODELS[n] for n in SHAPES)                        # one copy of each config
    assert "deepseek-v3" not in SHAPES                                       # the engine cannot build it
    assert param_counts(SHAPES["llama-3-70b"])["total"] == 70_553_706_496
    assert catalog_key("Qwen/Qwen3-8B") == "qwen3-8b" and catalog_key("gpt-5") is None
    assert WEIGHT_BYTES["fp8"] == 1.0
