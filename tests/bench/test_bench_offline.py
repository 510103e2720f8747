"""`shardserve bench latency / throughput` with random weights: the numbers they print come from a
real run, and the roofline's weight bytes match the parameters the model really has."""
from __future__ import annotations

import json
import os

import pytest

from shardserve.bench.shapes import SHAPES, param_counts
from shardserve.cli import main
from tests.tiny_models import make_tiny_checkpoint


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_param_counts_match_the_built_model(tmp_path, arch):
    from shardserve import LLM
    path = make_tiny_checkpoint(str(tmp_path / arch), arch)
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    llm = LLM(path, kv_cache_memory="8MiB", show_progress=False, dtype="float32")
    try:
        model = llm.engine.executor.worker.model_runner.model
        assert param_counts(config)["total"] == sum(p.numel() for p in model.parameters())
    finally:
        llm.engine.shutdown()


def test_builtin_shapes_have_their_published_sizes():
    published = {"llama-3-8b": 8.03, "llama-3-70b": 70.55, "qwen3-0.6b": 0.596, "qwen3-8b": 8.19,
                 "llama-3.1-405b": 405.85, "qwen3-32b": 32.76}
    billions = {name: param_counts(SHAPES[name])["total"] / 1e9 for name in published}
    assert billions == pytest.approx(published, abs=0.01)


def test_latency_and_throughput_with_random_weights(tmp_path, capsys):
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--random-weights", path, "--batch-size", "3", "--input-len", "12",
                 "--output-len", "9", "--num-iters", "3", "--num-iters-warmup", "1", "--kv-cache-memory", "32MiB",
                 "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "50% percentile latency" in printed and "roofline" in printed and "FLOPs utilisation" in printed
    lat = json.loads(out.read_text())
    assert lat["p10_latency_s"] <= lat["p50_latency_s"] <= lat["p99_latency_s"]
    assert 0 < lat["prefill_s"] < lat["p50_latency_s"] and lat["decode_step_ms"] > 0
    assert lat["roofline_step_ms"] > 0 and lat["bandwidth_gb_s"] > 0 and 0 < lat["mfu"] < 1
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--random-weights", path, "--num-prompts", "6", "--input-len", "10",
                 "--output-len", "5", "--random-range-ratio", "0.5", "--kv-cache-memory", "32MiB",
                 "--output-json", str(out)]) == 0
    tp = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "Roofline: no schedule" in printed
    assert tp["num_requests"] == 6 and tp["output_tokens_per_second"] > 0
    assert tp["tokens_per_second"] > tp["output_tokens_per_second"]
    # a tiny model's steps are host work: far above what its bytes and FLOPs allow
    assert 0 < tp["roofline_memory_s"] <= tp["roofline_s"] < tp["elapsed_time"] and tp["run_vs_roofline"] > 1
    assert tp["mfu"] < tp["roofline_mfu"]


def test_throughput_bound_by_hand():
    """The longest output's steps each read the weights; each decode token reads its context's KV."""
    from shardserve.bench.offline import model_flops, throughput_bound_s
    config = dict(SHAPES["qwen3-0.6b"], num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=4)   # 2 (K and V) x 1 KV head x 4 x 1 byte: 8 bytes of KV a token
    counts = param_counts(SHAPES["qwen3-0.6b"])
    lim = {"dense_bytes_per_rank": 100, "expert_bytes_per_rank": 0, "tp": 1, "bandwidth": 10.0,
           "peak_flops": 1e30, "counts": counts}
    # 4 steps x 100 bytes; KV: request 1 decodes 1 token over 3 + 1 keys, request 2 three over
    # 5 + 1, 5 + 2, 5 + 3: 25 tokens x 8 bytes
    assert throughput_bound_s(lim, config, 1, [3, 5], [2, 4]) == (60.0, 60.0)
    slow = dict(lim, peak_flops=1e6)   # FLOP-bound instead
    bound, memory = throughput_bound_s(slow, config, 1, [3, 5], [2, 4])
    assert memory == 60.0 and bound == model_flops(counts, 8, 6) / 1e6 > 60.0


def test_gguf_roofline_counts_the_bytes_held():
    """A GGUF file kept in its blocks: the roofline's weight bytes are what the model holds (0.09 GiB
    for the embedded Q4_1 SmolLM2), not its parameters at the serving dtype (0.27 GB in bf16)."""
    from shardserve import LLM
    from shardserve.bench.offline import _limits
    from shardserve.models.loader import load_hf_config, resolve_model_path
    path = resolve_model_path(None)
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=256, show_progress=False)
    try:
        lim = _limits(llm, load_hf_config(path))
        held = llm.engine.executor.collective_rpc("weight_bytes")[0]
    finally:
        llm.engine.shutdown()
    assert lim["weight_bytes_per_rank"] == held < 0.11e9 and "GGUF" in lim["dtype"]
    assert lim["dense_bytes_per_rank"] == held and lim["expert_bytes_per_rank"] == 0


def test_profile_writes_a_trace_per_worker(tmp_path, capsys, monkeypatch):
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    args = ["bench", "latency", "--random-weights", path, "--batch-size", "2", "--input-len", "6", "--output-len",
            "3", "--num-iters", "1", "--num-iters-warmup", "0", "--kv-cache-memory", "16MiB", "--profile"]
    monkeypatch.delenv("SHARDSERVE_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    assert main(args) == 2 and "SHARDSERVE_TORCH_PROFILER_DIR" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))   # vLLM's name works too
    out = tmp_path / "lat.json"
    assert main(args + ["-tp", "2", "--output-json", str(out)]) == 0
    printed = [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines()
               if line.startswith("profile trace: ")]
    assert sorted(printed) == sorted(json.loads(out.read_text())["profile_traces"])
    assert len(printed) == 2 and all(os.path.getsize(p) > 0 and "/traces/rank" in p for p in printed)
    out = tmp_path / "tp.json"   # throughput profiles its timed run
    assert main(["bench", "throughput", "--random-weights", path, "--num-prompts", "3", "--input-len", "6",
                 "--output-len", "3", "--kv-cache-memory", "16MiB", "--profile", "--output-json", str(out)]) == 0
    printed = [line.split(": ", 1)[1].split(" (")[0] for line in capsys.readouterr().out.splitlines()
               if line.startswith("profile trace: ")]
    assert printed == json.loads(out.read_text())["profile_traces"] and os.path.getsize(printed[0]) > 0


def test_latency_with_random_block_fp8_weights(tmp_path, capsys):
    """`-q fp8-block`: the shape as a block-scaled FP8 checkpoint (Qwen3-FP8's format), loaded as one
    (on the CPU widened after loading), its roofline counting FP8's byte per weight."""
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--random-weights", path, "-q", "fp8-block", "--batch-size", "1", "--input-len",
                 "8", "--output-len", "4", "--num-iters", "1", "--num-iters-warmup", "0", "--kv-cache-memory", "16MiB",
                 "--output-json", str(out)]) == 0
    assert "fp8 weights (blocks of 128 x 128)" in capsys.readouterr().out
    assert json.loads(out.read_text())["decode_step_ms"] > 0


def test_linear_bytes_follow_what_the_engine_holds():
    """The roofline's bytes per linear weight for stored formats: FP8 (also Meta's fbgemm_fp8) 1,
    4-bit GPTQ its packed bytes, 8-bit GPTQ and a pruned-only compressed-tensors model the compute
    dtype's (the engine dequantizes / stores them whole); compressed-tensors layers in several schemes
    and FP4 (4-bit on CUDA, dequantized on the CPU) as held (None)."""
    from shardserve.bench.offline import _linear_bytes
    base = {"hidden_size": 4096}

    def held(q: dict) -> float:
        return _linear_bytes(None, {**base, "quantization_config": q}, 2)[0]
    assert held({"quant_method": "fbgemm_fp8"}) == held({"quant_method": "fp8"}) == 1.0
    assert held({"quant_method": "modelopt", "quant_algo": "FP8"}) == 1.0
    # FP4: 4-bit on CUDA, dequantized on the CPU: as held
    assert held({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}) is None
    assert held({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",   # counted as held
                 "quantized_layers": {"model.layers.0.mlp": {"quant_algo": "FP8"}}}) is None
    assert held({"quant_method": "gptq", "bits": 4, "group_size": 128}) < 0.6
    assert held({"quant_method": "gptq", "bits": 8, "group_size": 128}) == 2.0
    assert held({"quant_method": "compressed-tensors", "sparsity_config": {"format": "dense"}}) == 2.0
    int4 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}
    one = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": int4}}}
    assert held(one) < 0.6
    nvfp4 = {"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16}
    assert held({**one, "format": "nvfp4-pack-quantized",
                 "config_groups": {"g": {"targets": ["Linear"], "weights": nvfp4}}}) is None
    # layers in several schemes (or only some targeted): counted as the engine holds them, not from the config
    assert held({**one, "config_groups": {"g": {"targets": ["re:.*mlp.*"], "weights": int4}}}) is None
    assert held({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*layers\\.0\\.": {}}}) is None
