"""The FP8 (E4M3) KV cache on CUDA: the Triton K/V stores (alone, fused with the rotary, inside the
decode kernel) give the bytes of the torch reference (kernels/attention/kv_fp8.py), the decode and
prefill kernels read an fp8 pool as the torch backend does, and a model serves with twice the
tokens, close to the bf16 cache's log-probs, graphs giving the eager tokens."""
from __future__ import annotations

import pytest
import torch

from shardserve.kernels.attention import kv_fp8
from shardserve.layers.attention import AttentionSpec, CommonAttentionMetadata, TorchAttentionBackend
from tests.gpu.test_cuda_kernels import _scattered_decodes

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("GPU-only: needs CUDA and Triton", allow_module_level=True)

FP8 = torch.float8_e4m3fn
DEV = torch.device("cuda")


def _wide(*shape: int) -> torch.Tensor:
    """Values over E4M3's whole range and past it: subnormals, ties, and some that saturate."""
    x = torch.randn(*shape, device=DEV) * torch.exp2(torch.randint(-12, 10, shape, device=DEV).float())
    return x


def _fp8_pool(kv_heads: int, pool: int, bs: int, dim: int) -> torch.Tensor:
    cache = torch.randn(2, kv_heads, pool, bs, dim, device=DEV).to(FP8)
    cache[:, :, 0] = 0
    return cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 3.1), (0.5, 1.7)])   # 1.7: bf16 hits ties
def test_triton_kv_stores_give_the_reference_bytes(dtype, k_scale, v_scale):
    """write_kv and the rotary + K/V write kernel against quantize() of the same values."""
    from shardserve.kernels.attention.triton_decode import write_kv
    from shardserve.kernels.rope.triton_rope import rotary_and_write_kv, rotary_neox_
    from shardserve.layers.rotary import RotaryEmbedding
    torch.manual_seed(0)
    t, heads, kv_heads, dim, bs, pool = 37, 8, 2, 128, 16, 20
    k, v = _wide(t, kv_heads, dim).to(dtype), _wide(t, kv_heads, dim).to(dtype)
    slots = torch.randperm((pool - 1) * bs, device=DEV)[:t] + bs
    cache = torch.zeros(2, kv_heads, pool, bs, dim, device=DEV, dtype=FP8)
    write_kv(k, v, cache[0], cache[1], slots, k_scale, v_scale)
    want = torch.zeros_like(cache)
    want[0, :, slots // bs, slots % bs] = kv_fp8.quantize(k.transpose(0, 1), k_scale)
    want[1, :, slots // bs, slots % bs] = kv_fp8.quantize(v.transpose(0, 1), v_scale)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    # fused with the rotary: the rotated k's bytes
    rope = RotaryEmbedding(dim, 4096, 500000.0).to(DEV)
    positions = torch.randint(0, 4096, (t,), device=DEV)
    qkv = _wide(t, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(t, heads, dim), k.view(t, kv_heads, dim), v.reshape(t, kv_heads, dim)
    q2, k2 = q.clone(), k.clone()
    rotary_neox_(positions, q2, k2, rope.cos, rope.sin)
    fused = torch.zeros_like(cache)
    rotary_and_write_kv(positions, q, k, v, rope.cos, rope.sin, fused[0], fused[1], slots, k_scale, v_scale)
    assert torch.equal(q, q2)
    want[0, :, slots // bs, slots % bs] = kv_fp8.quantize(k2.transpose(0, 1), k_scale)
    want[1, :, slots // bs, slots % bs] = kv_fp8.quantize(v.transpose(0, 1), v_scale)
    assert torch.equal(fused.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(64, 8, 2, None), (128, 32, 8, None), (64, 6, 6, 40)])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_triton_decode_reads_fp8_as_the_torch_backend(dtype, head_dim, heads, kv_heads, window, splits, monkeypatch):
    from shardserve.kernels.attention import triton_decode
    from shardserve.layers.attention.cuda_backend import CudaAttentionBackend
    if splits is not None:
        monkeypatch.setattr(triton_decode, "num_splits", lambda *a: splits)
    torch.manual_seed(1)
    bs, pool = 16, 200
    spec = AttentionSpec(heads, kv_heads, head_dim, head_dim ** -0.5, window, k_scale=0.5, v_scale=1.7)
    lens = [1, 17, 100, 333, 64, 2000]
    common = _scattered_decodes(lens, bs, pool, DEV)
    cache = _fp8_pool(kv_heads, pool, bs, head_dim)
    q, k, v = (torch.randn(len(lens), h, head_dim, device=DEV).to(dtype) for h in (heads, kv_heads, kv_heads))
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), CudaAttentionBackend()):
        c = cache.clone()
        outs.append(backend.forward(spec, q, k, v, c, backend.build(common, DEV)).float())
        caches.append(c.view(torch.uint8))
    assert torch.equal(caches[0], caches[1])
    # Both read the same E4M3 values; they differ only by where the scales are applied (the torch
    # backend rounds value x scale to the activations' dtype, the kernel folds the scales into the
    # softmax scale and the output) and by accumulation order: bf16 rounding, as for a bf16 pool.
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(outs[0], outs[1], atol=tol, rtol=tol), (outs[0] - outs[1]).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(64, 8, 2, None), (128, 32, 8, None), (64, 6, 6, 40)])
def test_triton_prefill_reads_fp8_as_the_torch_backend(dtype, head_dim, heads, kv_heads, window):
    """Decodes and prefill chunks with and without a cached prefix in one step (the prefill kernel's
    test in test_cuda_kernels.py, on an fp8 pool)."""
    from shardserve.layers.attention.cuda_backend import CudaAttentionBackend
    torch.manual_seed(2)
    bs, pool = 16, 200
    spec = AttentionSpec(heads, kv_heads, head_dim, head_dim ** -0.5, window, k_scale=0.8, v_scale=0.3)
    context, query = [40, 7, 0, 0, 16, 100], [1, 1, 1, 37, 70, 129]
    perm = torch.randperm(pool - 1) + 1
    tables, used, slots = torch.zeros(len(context), 17, dtype=torch.int32), 0, []
    for i, (c, n) in enumerate(zip(context, query)):
        nb = -(-(c + n) // bs)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(c, c + n)]
    common = CommonAttentionMetadata(2, query, context, tables.to(DEV), torch.tensor(slots, device=DEV), bs)
    cache = _fp8_pool(kv_heads, pool, bs, head_dim)
    t = sum(query)
    q, k, v = (torch.randn(t, h, head_dim, device=DEV).to(dtype) for h in (heads, kv_heads, kv_heads))
    outs = []
    for backend in (TorchAttentionBackend(), CudaAttentionBackend()):
        outs.append(backend.forward(spec, q, k, v, cache.clone(), backend.build(common, DEV)).float())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(outs[0], outs[1], atol=tol, rtol=tol), (outs[0] - outs[1]).abs().max()


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_with_rotary_inside_stores_fp8_as_the_separate_kernels(splits, monkeypatch):
    """A decode-only step with the rotation and the fp8 store inside the attention kernel: the bits
    of the rotary + K/V write kernel followed by the attention kernel, output and pool."""
    from shardserve.kernels.attention import triton_decode
    from shardserve.layers.attention import cuda_backend
    from shardserve.layers.rotary import RotaryEmbedding
    monkeypatch.setattr(triton_decode, "num_splits", lambda *a: splits)
    torch.manual_seed(4)
    heads, kv_heads, head_dim, bs, pool = 32, 8, 128, 16, 200
    spec = AttentionSpec(heads, kv_heads, head_dim, head_dim ** -0.5, None, k_scale=0.6, v_scale=1.3)
    lens = [0, 15, 16, 100, 333, 2000]
    common = _scattered_decodes(lens, bs, pool, DEV)
    cache = _fp8_pool(kv_heads, pool, bs, head_dim)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, device=DEV).to(torch.bfloat16)
    rope = RotaryEmbedding(head_dim, 4096, 500000.0).to(DEV)
    rotary = (torch.tensor(lens, device=DEV), rope.cos, rope.sin)
    outs, caches = [], []
    for inside in (False, True):
        monkeypatch.setattr(cuda_backend, "ROPE_IN_DECODE", inside)
        x, c = qkv.clone(), cache.clone()
        q, k, v = x.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.reshape(-1, kv_heads, head_dim)
        backend = cuda_backend.CudaAttentionBackend()
        outs.append(backend.forward(spec, q, k, v, c, backend.build(common, DEV), rotary))
        caches.append(c.view(torch.uint8))
    assert torch.equal(caches[0], caches[1])
    assert torch.equal(outs[0], outs[1])


def test_model_serves_with_an_fp8_cache(tmp_path):
    """A tiny model on the GPU: twice the KV tokens of bf16 in the same memory, log-probs close to
    the bf16 cache's within the CPU test's bounds (tests/layers/test_kv_fp8.py: teacher-forced
    prompt positions, prefill chunks reading an fp8 prefix, then greedy decodes), and CUDA graphs
    give the eager tokens."""
    import random

    from shardserve import LLM, SamplingParams
    from tests.layers.test_kv_fp8 import _assert_close, kv_cache_tokens, log_lines
    from tests.tiny_models import make_tiny_checkpoint
    # head_dim 32 (a Triton tile size; the default tiny shape's 24 takes the torch backend)
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(200)] for _ in range(3)]

    def run(kv: str, eager: bool):
        with log_lines() as lines:
            llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_memory="64MiB", show_progress=False,
                      kv_cache_dtype=kv, enforce_eager=eager, max_num_batched_tokens=64)
        try:
            runner = llm.engine.executor.worker.model_runner
            assert runner.backend.name == "cuda-triton" and {c.dtype for c in runner.kv_caches} == {
                torch.bfloat16 if kv == "auto" else FP8}
            return llm.generate(prompts, params, use_tqdm=False), kv_cache_tokens(lines)
        finally:
            llm.engine.shutdown()

    bf16, bf16_tokens = run("auto", eager=True)
    fp8, fp8_tokens = run("fp8", eager=True)
    graphs, _ = run("fp8_e4m3", eager=False)
    assert abs((fp8_tokens + 16) - 2 * (bf16_tokens + 16)) <= 32, (fp8_tokens, bf16_tokens)   # block 0 reserved
    _assert_close(bf16, fp8, prompts)
    assert [r.outputs[0].token_ids for r in fp8] == [r.outputs[0].token_ids for r in graphs]
