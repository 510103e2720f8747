"""The FP8 (E4M3) KV cache on the CPU (`--kv-cache-dtype fp8`): the native kernels' store against
torch's float8_e4m3fn cast (kernels/attention/kv_fp8.py), both backends reading an fp8 pool alike,
half the bytes per block (twice the tokens in the capacity line, as `plan` says), greedy decoding
close to a bf16/fp32 cache, and k_scale / v_scale read from checkpoints under their tools' names."""
from __future__ import annotations

import contextlib
import json
import logging
import os

import pytest
import torch

from shardserve.kernels.attention import kv_fp8
from shardserve.kernels.cpu import cpu_ops
from shardserve.layers.attention import AttentionSpec, CommonAttentionMetadata, TorchAttentionBackend
from shardserve.layers.attention.cpu_native import CpuNativeAttentionBackend

FP8 = torch.float8_e4m3fn
needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels not built here")


@contextlib.contextmanager
def log_lines():
    """The messages the `shardserve` loggers emit inside the block (that logger does not propagate
    to the root, so pytest's caplog misses them)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("shardserve")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def kv_cache_tokens(lines: list[str]) -> int:
    """N of the engine's `KV cache size: N tokens` line."""
    return next(int(line.split()[3]) for line in lines if line.startswith("KV cache size:"))


def _edge_values() -> torch.Tensor:
    """Every E4M3 value, the midpoints between neighbours (ties: nearest even decides), values just
    beside them, past 448 (saturation), zeros of both signs, NaN aside."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[~codes.isnan()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    near = torch.cat([mids * (1 + 2 ** -20), mids * (1 - 2 ** -20)])
    big = torch.tensor([448.0, 460.0, 464.0, 470.0, 1e4, float("inf")])
    values = torch.cat([finite, mids, near, big, -big, torch.tensor([0.0, -0.0, 2 ** -10, 3 * 2 ** -11])])
    return values


@needs_kernels
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 3.1), (2.0 ** -6, 5e3)])
def test_native_store_gives_torchs_bytes(k_scale, v_scale):
    values = _edge_values()
    dim = 8
    n = -(-values.numel() // dim)
    padded = torch.zeros(n * dim)
    padded[:values.numel()] = values
    k = (padded * k_scale).view(n, 1, dim)   # x / scale then lands on the edge values
    v = torch.randn(n, 1, dim) * torch.exp2(torch.randint(-14, 12, (n, 1, dim)).float())
    bs = 4
    cache = torch.zeros(2, 1, -(-n // bs) + 1, bs, dim, dtype=FP8)
    slots = torch.randperm(n) + bs   # scattered, never the null block
    cpu_ops.write_kv(k, v, cache[0], cache[1], slots, k_scale, v_scale)
    want = torch.zeros_like(cache)
    want[0, :, slots // bs, slots % bs] = kv_fp8.quantize(k.transpose(0, 1), k_scale)
    want[1, :, slots // bs, slots % bs] = kv_fp8.quantize(v.transpose(0, 1), v_scale)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    assert kv_fp8.dequantize(cache[0, 0].reshape(-1), 1.0).abs().max() <= 448


def _two_steps(backend, spec, cache_dtype, heads, kv_heads, dim, transform=None):
    """A first step fills three prefixes; the second has three decodes (one on a single token) and
    a prefill chunk over a cached prefix: every read path. transform(k or v, "k"/"v") changes the
    K/V before they are written (for a reference on already-rounded values)."""
    bs, pool = 4, 24
    tables = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7], [8, 0, 0, 0], [9, 10, 0, 0]], dtype=torch.int32)
    ctx, new = [9, 13, 0, 3], [1, 1, 1, 4]

    def slots(r, positions):
        return [int(tables[r, p // bs]) * bs + p % bs for p in positions]

    def inputs(n, seed):
        q, k, v = (torch.randn(n, h, dim, generator=torch.Generator().manual_seed(seed + i)) * 3
                   for i, h in enumerate((heads, kv_heads, kv_heads)))
        return (q, k, v) if transform is None else (q, transform(k, "k"), transform(v, "v"))

    first = CommonAttentionMetadata(0, [9, 13, 3], [0] * 3, tables[[0, 1, 3]], torch.tensor(
        slots(0, range(9)) + slots(1, range(13)) + slots(3, range(3))), bs)
    second = CommonAttentionMetadata(3, new, ctx, tables, torch.tensor(
        slots(0, [9]) + slots(1, [13]) + slots(2, [0]) + slots(3, range(3, 7))), bs)
    cache = torch.zeros(backend.kv_cache_shape(pool, bs, kv_heads, dim), dtype=cache_dtype)
    backend.forward(spec, *inputs(sum(ctx), 0), cache, backend.build(first, torch.device("cpu")))
    out = backend.forward(spec, *inputs(sum(new), 10), cache, backend.build(second, torch.device("cpu")))
    return out, cache


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 16), (8, 2, 40), (4, 4, 64), (8, 1, 32)])
def test_torch_backend_reads_fp8_as_its_values(window, heads, kv_heads, dim):
    """The torch backend on an fp8 pool is the torch backend on an fp32 pool holding the values
    the fp8 one dequantizes to."""
    spec = AttentionSpec(heads, kv_heads, dim, 0.25, window, k_scale=0.7, v_scale=1.9)
    got, got_cache = _two_steps(TorchAttentionBackend(), spec, FP8, heads, kv_heads, dim)

    def rounded(x, which):
        scale = spec.k_scale if which == "k" else spec.v_scale
        return kv_fp8.dequantize(kv_fp8.quantize(x, scale), scale)

    want, want_cache = _two_steps(TorchAttentionBackend(), spec, torch.float32, heads, kv_heads, dim, rounded)
    assert torch.equal(kv_fp8.dequantize(got_cache[0], spec.k_scale), want_cache[0])
    assert torch.equal(kv_fp8.dequantize(got_cache[1], spec.v_scale), want_cache[1])
    assert torch.allclose(got, want, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 16), (8, 2, 40), (4, 4, 64), (8, 1, 32)])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.7, 1.9)])
def test_native_backend_reads_fp8_as_the_torch_backend(window, heads, kv_heads, dim, k_scale, v_scale):
    """Head shapes cover every register blocking of the native kernel. Both backends hold the same
    bytes; reads differ only where the scales are applied (the native kernel folds them into the
    softmax scale and the normaliser) and in summation order: fp32 rounding."""
    spec = AttentionSpec(heads, kv_heads, dim, 0.25, window, k_scale=k_scale, v_scale=v_scale)
    got, got_cache = _two_steps(CpuNativeAttentionBackend(), spec, FP8, heads, kv_heads, dim)
    want, want_cache = _two_steps(TorchAttentionBackend(), spec, FP8, heads, kv_heads, dim)
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5), (got - want).abs().max()


def test_fp8_pool_holds_twice_the_tokens_of_bf16_and_the_planner_agrees(tmp_path):
    """Bytes per block halve against bf16 (a quarter of fp32), and `plan --kv-cache-dtype fp8` counts
    the same bytes per token as the engine."""
    from shardserve.kernels.attention.kv_fp8 import FP8_KV
    from shardserve.models.loader import build_model
    from shardserve.planner.memory import ModelShape
    from shardserve.worker.kv_sizing import kv_bytes_per_block
    from tests.tiny_models import tiny_hf_config
    config = tiny_hf_config("llama", num_hidden_layers=3).to_dict()
    model = build_model(config, torch.float32, torch.device("cpu"))
    per_block = {dt: kv_bytes_per_block(model, 16, dt) for dt in (torch.float32, torch.bfloat16, FP8_KV)}
    assert per_block[torch.bfloat16] == 2 * per_block[FP8_KV] and per_block[torch.float32] == 4 * per_block[FP8_KV]
    shape = ModelShape(config)
    for name in ("fp8", "fp8_e4m3"):
        from shardserve.planner.memory import norm_dtype
        assert shape.kv_bytes_per_token(norm_dtype(name)) * 16 == per_block[FP8_KV]


def _generate(path, kv: str, dtype: str, prompts, params, **kwargs):
    from shardserve import LLM
    with log_lines() as lines:
        llm = LLM(path, dtype=dtype, kv_cache_memory="8MiB", show_progress=False, kv_cache_dtype=kv, **kwargs)
    try:
        runner = llm.engine.executor.worker.model_runner
        return llm.generate(prompts, params, use_tqdm=False), kv_cache_tokens(lines), runner, lines
    finally:
        llm.engine.shutdown()


# How far an fp8 cache may move log-probs from the default cache's, on these tiny random models.
# E4M3 keeps 3 mantissa bits: each cached key and value is within 2^-4 (6.25%) of its own value,
# about 3.6% RMS. Attention averages many of them (errors partly cancel) and two layers carry the
# result to the logits, so a log-prob moves by a few hundredths of a nat on average and a few tenths
# at worst. Measured (597 teacher-forced positions, bf16 and fp32, native and torch paths): mean
# 0.025, max 0.13 on this shape; mean 0.035, max 0.20 with head_dim 32 (the GPU test's). The bounds
# leave room for that and for bf16 math on a GPU, and the mean still fails a pool read at a wrong
# scale: reading values 25% too large moved log-probs by mean 0.20 (max 1.1).
MEAN_TOL, MAX_TOL = 0.06, 0.5


def _assert_close(reference, fp8, prompts) -> None:
    """Teacher-forced: every prompt position's log-prob of the next prompt token (prefill chunks
    reading an fp8 prefix). Then greedy decoding (decodes reading it): the same tokens until a near
    tie of the reference flips (the sequences part there), log-probs within MAX_TOL up to it."""
    diffs = [abs(la[t].logprob - lb[t].logprob) for a, b, p in zip(reference, fp8, prompts)
             for la, lb, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], p[1:])]
    assert len(diffs) == sum(len(p) - 1 for p in prompts)
    assert sum(diffs) / len(diffs) < MEAN_TOL and max(diffs) < MAX_TOL, (sum(diffs) / len(diffs), max(diffs))
    for a, b in zip(reference, fp8):
        for la, lb, ta, tb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids,
                                  b.outputs[0].token_ids):
            if ta != tb:
                assert la[ta].logprob - la[tb].logprob < MAX_TOL, (la, lb)
                break
            assert abs(la[ta].logprob - lb[tb].logprob) < MAX_TOL, (la[ta], lb[tb])


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_with_fp8_cache_doubles_tokens_and_stays_close(tmp_path, monkeypatch, native, dtype):
    """Against the default cache (bf16 when serving bf16, the compute dtype otherwise): the capacity
    line shows twice the tokens of a bf16 pool (four times an fp32 one's), log-probs stay close.
    Prompts longer than the token budget, so prefill chunks read an fp8 prefix."""
    import random

    from shardserve import SamplingParams
    from tests.tiny_models import make_tiny_checkpoint
    if native and not cpu_ops.available():
        pytest.skip("native CPU kernels not built here")
    if not native:
        monkeypatch.setenv("SHARDSERVE_CPU_KERNELS", "0")
        cpu_ops._library.cache_clear()
    try:
        path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=0)
        rng = random.Random(0)
        prompts = [[rng.randrange(300) for _ in range(200)] for _ in range(3)]
        auto, auto_tokens, auto_runner, _ = _generate(path, "auto", dtype, prompts, params,
                                                      max_num_batched_tokens=64)
        fp8, fp8_tokens, runner, lines = _generate(path, "fp8", dtype, prompts, params, max_num_batched_tokens=64)
    finally:
        if not native:
            monkeypatch.delenv("SHARDSERVE_CPU_KERNELS")
            cpu_ops._library.cache_clear()
    assert runner.backend.name == ("cpu-native" if native else "torch")
    assert {c.dtype for c in runner.kv_caches} == {FP8}
    ratio = auto_runner.kv_caches[0].element_size()
    # The same bytes hold `ratio` times the blocks (up to one block of rounding; block 0 is reserved).
    assert abs((fp8_tokens + 16) - ratio * (auto_tokens + 16)) <= 16 * ratio, (fp8_tokens, auto_tokens)
    assert any("k_scale = v_scale = 1.0" in line for line in lines)
    _assert_close(auto, fp8, prompts)


def _add_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """A checkpoint shard more, listed in the index, as a quantization tool would add its scales."""
    from safetensors.torch import save_file
    save_file(tensors, os.path.join(path, "kv-scales.safetensors"))
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    data["weight_map"].update({name: "kv-scales.safetensors" for name in tensors})
    with open(index, "w") as f:
        json.dump(data, f)


@pytest.mark.parametrize("spelling", ["self_attn", "proj", "output_scale", "kv_scale"])
def test_checkpoint_kv_scales_are_read(tmp_path, spelling):
    """Each tool's spelling lands in the layer's scales (the old single kv_scale in both); the log
    line says so; the scales change nothing with the default cache."""
    from shardserve import SamplingParams
    from tests.tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [[5, 9, 33, 2, 71, 40, 12] * 3]
    plain, *_ = _generate(path, "auto", "float32", prompts, params)
    want = {}
    tensors = {}
    for layer in range(2):
        k, v = torch.tensor(0.5 + layer), torch.tensor([0.25 * (layer + 1)])   # scalar and [1] shapes
        prefix = f"model.layers.{layer}.self_attn"
        if spelling == "self_attn":
            tensors |= {f"{prefix}.k_scale": k, f"{prefix}.v_scale": v}
        elif spelling == "proj":
            tensors |= {f"{prefix}.k_proj.k_scale": k, f"{prefix}.v_proj.v_scale": v}
        elif spelling == "output_scale":
            tensors |= {f"{prefix}.k_proj.output_scale": k, f"{prefix}.v_proj.output_scale": v,
                        f"{prefix}.q_proj.output_scale": k.clone()}   # read as nothing
        else:
            tensors |= {f"{prefix}.kv_scale": k}
            v = k
        want[layer] = (float(k), float(v))
    _add_tensors(path, tensors)
    with_scales, _, runner, _ = _generate(path, "auto", "float32", prompts, params)
    assert with_scales[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert with_scales[0].outputs[0].logprobs == plain[0].outputs[0].logprobs
    _, _, runner, lines = _generate(path, "fp8", "float32", prompts, params)
    for layer, attn in enumerate(runner.model.attention_layers()):
        assert (attn.spec.k_scale, attn.spec.v_scale) == want[layer]
        assert (float(attn.k_scale), float(attn.v_scale)) == want[layer]
    assert any("the checkpoint's k_scale / v_scale in 2 of 2 layers" in line for line in lines)


def test_unsupported_kv_cache_dtypes_are_refused(tmp_path):
    from shardserve import LLM
    from tests.tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    for name, says in (("fp8_e5m2", "E5M2 is not supported"), ("int8", "choose auto, fp8, fp8_e4m3")):
        with pytest.raises(ValueError, match=says):
            LLM(path, kv_cache_memory="8MiB", show_progress=False, kv_cache_dtype=name)


def test_embedded_smollm2_keeps_its_perplexity_with_an_fp8_cache():
    """Real weights (the embedded SmolLM2-135M): perplexity on a fixed English text with the fp8
    cache (scales 1.0) within 2% of the default cache's (measured: 19.78 against 19.67, +0.55%).
    Its greedy answer to the France question is not checked: in bf16 the first token is a near tie
    ('The' -1.84 against 'L' -1.96 nats) that the fp8 cache flips."""
    import math

    from shardserve import LLM, SamplingParams
    from tests.quantization.checkpoints import ENGLISH_TEXT

    def perplexity(kv: str) -> float:
        llm = LLM(show_progress=False, kv_cache_memory="64MiB", max_model_len=1024, kv_cache_dtype=kv)
        try:
            out = llm.generate([ENGLISH_TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        finally:
            llm.engine.shutdown()
        lps = [row[t].logprob for row, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        return math.exp(-sum(lps) / len(lps))

    full, fp8 = perplexity("auto"), perplexity("fp8")
    assert abs(fp8 / full - 1) <= 0.02, (fp8, full)


def test_cli_flag_reaches_the_engine_args():
    import argparse

    from shardserve.cli import add_engine_args, engine_args_from
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"])).kv_cache_dtype == "fp8_e4m3"
    assert engine_args_from(parser.parse_args([])).kv_cache_dtype == "auto"


def test_gpus_without_fp8_are_refused_at_start_up(monkeypatch):
    """The Triton kernels need E4M3 (compute capability 8.9+): an A100 is told so, before any pool."""
    from types import SimpleNamespace

    from shardserve.layers.attention.cuda_backend import CudaAttentionBackend
    from shardserve.worker.kv_sizing import check_fp8_kv_cache
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    runner = SimpleNamespace(kv_cache_dtype=FP8, backend=CudaAttentionBackend(), device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"A100-SXM4-80GB is 8\.0\. Use --kv-cache-dtype auto"):
        check_fp8_kv_cache(runner)
