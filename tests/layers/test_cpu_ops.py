"""The native CPU kernels (kernels/cpu/csrc/cpu_ops.c) against plain torch: the same numbers to fp32
rounding, bit-identical rows whatever the batch, and the engine giving the same tokens with and
without them."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from shardserve.config import cpu_flags
from shardserve.kernels.activation import reference as activation_reference
from shardserve.kernels.cpu import cpu_ops
from shardserve.kernels.norm import reference as norm_reference
from shardserve.kernels.rope.reference import rotate_neox
from shardserve.layers.activation import SiluAndMul
from shardserve.layers.attention import AttentionSpec, CommonAttentionMetadata, TorchAttentionBackend
from shardserve.layers.attention.cpu_native import CpuNativeAttentionBackend
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryEmbedding


def test_kernels_build_on_this_machine():
    """CI runs on x86 with AVX2 and a C compiler: the kernels must be there, not silently skipped."""
    if not {"avx2", "fma", "f16c"} <= cpu_flags() or not shutil.which("cc"):
        pytest.skip("needs an x86 CPU with AVX2/FMA/F16C and a C compiler")
    if os.environ.get("SHARDSERVE_CPU_KERNELS") == "0":
        pytest.skip("SHARDSERVE_CPU_KERNELS=0: this run tests the plain-torch path")
    assert cpu_ops.available()


# Machines without AVX2 or a C compiler serve through plain torch; there is nothing native to test.
# CI has both, and test_kernels_build_on_this_machine fails there if the kernels do not build.
needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="needs the native CPU kernels (off: "
                                   "SHARDSERVE_CPU_KERNELS=0, no AVX2/FMA/F16C, or no C compiler)")


@needs_kernels
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(64, 32), (100, 72), (37, 13), (48, 1536)])
@pytest.mark.parametrize("m", [1, 2, 7, 40, 130])
def test_linear_matches_fp64_reference(m, n, k, weight_dtype):
    torch.manual_seed(m * 1000 + n)
    w = torch.randn(n, k).to(weight_dtype)
    bias = torch.randn(n)
    x = torch.randn(m, k)
    packed = cpu_ops.pack_weight(w, weight_dtype)
    assert packed.dtype == weight_dtype
    got = cpu_ops.linear_packed(x, packed, bias)
    want = x.double() @ w.double().t() + bias.double()
    assert got.shape == (m, n)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_kernels
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_linear_rows_are_batch_invariant(weight_dtype):
    """Each row comes out bit-identical alone, in small batches (the bf16 path) and in big ones
    (the widened-panel path)."""
    torch.manual_seed(0)
    w = cpu_ops.pack_weight(torch.randn(200, 96), weight_dtype)
    x = torch.randn(150, 96)
    full = cpu_ops.linear_packed(x, w)
    for size in (1, 2, 5, 31, 33):
        for start in (0, 3, 117):
            assert torch.equal(cpu_ops.linear_packed(x[start:start + size], w), full[start:start + size])


@needs_kernels
def test_linear_takes_strided_and_3d_inputs():
    torch.manual_seed(1)
    w = torch.randn(32, 24).bfloat16()
    x = torch.randn(2, 5, 48)[..., ::2]   # last dim strided
    got = cpu_ops.linear_packed(x, cpu_ops.pack_weight(w))
    assert torch.allclose(got, x @ w.float().t(), atol=1e-5)
    # bf16 activations (native half-precision compute: the LM head's fp32 logits) are widened exactly
    xb = x.bfloat16()
    packed = cpu_ops.pack_weight(w)
    assert torch.equal(cpu_ops.linear_packed(xb, packed), cpu_ops.linear_packed(xb.float(), packed))


@needs_kernels
def test_small_layers_match_torch():
    torch.manual_seed(2)
    x, res = torch.randn(5, 40), torch.randn(5, 40)
    norm = RMSNorm(40, eps=1e-5)
    norm.weight.data.normal_()
    want = norm_reference.rms_norm(x + res, norm.weight, 1e-5)
    got, new_res = norm(x, res.clone())
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(new_res, x + res)
    assert torch.allclose(norm(x), norm_reference.rms_norm(x, norm.weight, 1e-5), atol=1e-5)
    # Per-head norms on q inside fused qkv rows (Qwen3): strided rows, no copy in, a packed result.
    head_norm = RMSNorm(16, eps=1e-6)
    head_norm.weight.data.normal_()
    qkv = torch.randn(5, 5 * 16)
    q = qkv[:, :48].view(5, 3, 16)
    got = head_norm(q)
    assert got.is_contiguous() and torch.allclose(got, norm_reference.rms_norm(q, head_norm.weight, 1e-6), atol=1e-5)
    assert torch.equal(got[2:3], head_norm(qkv[2:3, :48].contiguous().view(1, 3, 16)))   # the rows' kernel's bits
    gate_up = torch.randn(3, 2 * 20) * 4
    assert torch.allclose(SiluAndMul()(gate_up), activation_reference.silu_and_mul(gate_up), atol=1e-5)
    rope = RotaryEmbedding(16, 64, 10000.0)
    qkv = torch.randn(4, (3 + 1 + 1) * 16)
    q, k = qkv[:, :48].view(4, 3, 16), qkv[:, 48:64].view(4, 1, 16)
    positions = torch.tensor([0, 5, 63, 7])
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    want_q, want_k = rotate_neox(q.clone(), cos, sin), rotate_neox(k.clone(), cos, sin)
    got_q, got_k = rope(positions, q, k)   # rotated in place, inside qkv
    assert torch.allclose(got_q, want_q, atol=1e-6) and torch.allclose(got_k, want_k, atol=1e-6)
    assert torch.equal(qkv[:, :48].view(4, 3, 16), got_q)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 16), (8, 2, 40), (4, 4, 64), (8, 1, 32)])
def test_paged_attention_matches_torch_backend(kv_dtype, window, heads, kv_heads, dim):
    """A step with three decodes (one sitting on a single token) and a prefill over a cached prefix.
    The K/V of earlier tokens are written by a first step, so decodes read them from the pool.
    Head shapes cover every register blocking of the kernel (query heads per KV head 1, 3, 4, 8;
    head_dim in 8- and 32-wide steps)."""
    torch.manual_seed(3)
    spec = AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, scale=0.25, sliding_window=window)
    bs, pool = 4, 24
    tables = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7], [8, 0, 0, 0], [9, 10, 0, 0]], dtype=torch.int32)
    ctx = [9, 13, 0, 3]          # tokens already cached per request
    new = [1, 1, 1, 4]           # three decodes, then a 4-token prefill chunk

    def slots(r, positions):
        return [int(tables[r, p // bs]) * bs + p % bs for p in positions]

    def run(backend, dtype_of_cache, rounded):
        # Step 1 fills the prefixes (as prefills); step 2 is the mixed step under test.
        first = CommonAttentionMetadata(0, [c for c in ctx if c], [0] * 3, tables[[0, 1, 3]], torch.tensor(
            slots(0, range(9)) + slots(1, range(13)) + slots(3, range(3))), bs)
        n1 = sum(ctx)
        q1, k1, v1 = (torch.randn(n1, h, dim, generator=torch.Generator().manual_seed(i))
                      for i, h in enumerate((heads, kv_heads, kv_heads)))
        second = CommonAttentionMetadata(3, new, ctx, tables, torch.tensor(
            slots(0, [9]) + slots(1, [13]) + slots(2, [0]) + slots(3, range(3, 7))), bs)
        n2 = sum(new)
        q2, k2, v2 = (torch.randn(n2, h, dim, generator=torch.Generator().manual_seed(10 + i))
                      for i, h in enumerate((heads, kv_heads, kv_heads)))
        if rounded:   # the values a bf16 pool holds, for a torch backend on an fp32 pool
            k1, v1, k2, v2 = (t.bfloat16().float() for t in (k1, v1, k2, v2))
        cache = torch.zeros(backend.kv_cache_shape(pool, bs, kv_heads, dim), dtype=dtype_of_cache)
        backend.forward(spec, q1, k1, v1, cache, backend.build(first, torch.device("cpu")))
        return backend.forward(spec, q2, k2, v2, cache, backend.build(second, torch.device("cpu"))), cache

    got, got_cache = run(CpuNativeAttentionBackend(), kv_dtype, rounded=False)
    want, want_cache = run(TorchAttentionBackend(), torch.float32, rounded=kv_dtype == torch.bfloat16)
    assert torch.equal(got_cache.float(), want_cache)
    assert torch.allclose(got[:3], want[:3], atol=1e-5), "decodes"
    assert torch.allclose(got[3:], want[3:], atol=1e-5), "prefill"


@needs_kernels
def test_engine_gives_the_same_tokens_without_the_kernels(tmp_path, monkeypatch):
    """bf16 served through the kernels (bf16 weights and KV) and through plain torch (fp32 holding
    bf16 values): the same greedy tokens, log-probs close. fp32 math on both sides, whatever the
    CPU (without the kernels a CPU with bf16 units would otherwise take torch's bf16 math)."""
    from shardserve import LLM, SamplingParams
    monkeypatch.setenv("SHARDSERVE_CPU_NATIVE_HALF", "0")
    from tests.tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [[5, 9, 33, 2, 71, 40, 12], [8] * 20]

    def run():
        llm = LLM(path, dtype="bfloat16", kv_cache_memory="8MiB", show_progress=False)
        try:
            return llm.generate(prompts, params, use_tqdm=False), llm.engine.executor.worker.model_runner.backend.name
        finally:
            llm.engine.shutdown()

    native, name = run()
    assert name == "cpu-native"
    monkeypatch.setenv("SHARDSERVE_CPU_KERNELS", "0")
    cpu_ops._library.cache_clear()
    try:
        plain, name = run()
    finally:
        monkeypatch.delenv("SHARDSERVE_CPU_KERNELS")
        cpu_ops._library.cache_clear()
    assert name == "torch"
    for a, b in zip(native, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            token = next(iter(la))
            assert abs(la[token].logprob - lb[token].logprob) < 0.05
