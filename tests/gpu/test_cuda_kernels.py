"""The Triton paged decode kernel against the plain-torch backend (the oracle), and CUDA-graph decode
steps against eager ones: same tokens."""
from __future__ import annotations

import gc

import pytest
import torch

from shardserve.layers.attention import AttentionSpec, CommonAttentionMetadata, TorchAttentionBackend

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("GPU-only: needs CUDA and Triton", allow_module_level=True)


def _scattered_decodes(lens: list[int], bs: int, pool: int, dev: torch.device) -> CommonAttentionMetadata:
    """One decode token per request after `lens` tokens of context, each request's blocks scattered
    over a pool of `pool` (never the null block), in a table 131 blocks wide (not a multiple of the
    pages the kernel takes per step)."""
    perm = torch.randperm(pool - 1) + 1
    tables, used = torch.zeros(len(lens), 131, dtype=torch.int32), 0
    for i, n in enumerate(lens):
        nb = -(-(n + 1) // bs)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    slots = torch.tensor([int(tables[i, n // bs]) * bs + n % bs for i, n in enumerate(lens)], device=dev)
    return CommonAttentionMetadata(len(lens), [1] * len(lens), lens, tables.to(dev), slots, bs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(64, 8, 2, None), (128, 32, 8, None), (64, 6, 6, 40)])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("splits", [1, 3, None])   # None: as many as the kernel picks for this batch
def test_triton_decode_matches_torch_reference(dtype, head_dim, heads, kv_heads, window, bs, splits, monkeypatch):
    from shardserve.kernels.attention import triton_decode
    from shardserve.layers.attention.cuda_backend import CudaAttentionBackend
    if splits is not None:
        monkeypatch.setattr(triton_decode, "num_splits", lambda *a: splits)
    torch.manual_seed(0)
    dev, pool = torch.device("cuda"), 200
    spec = AttentionSpec(heads, kv_heads, head_dim, head_dim ** -0.5, window)
    lens = [1, 17, 100, 333, 64, 2000]                # context before the new token
    common = _scattered_decodes(lens, bs, pool, dev)
    cache = torch.randn(2, kv_heads, pool, bs, head_dim, device=dev).to(dtype)
    cache[:, :, 0] = 0
    q = torch.randn(len(lens), heads, head_dim, device=dev).to(dtype)
    k = torch.randn(len(lens), kv_heads, head_dim, device=dev).to(dtype)
    v = torch.randn(len(lens), kv_heads, head_dim, device=dev).to(dtype)
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), CudaAttentionBackend()):
        c = cache.clone()
        outs.append(backend.forward(spec, q, k, v, c, backend.build(common, dev)).float())
        caches.append(c)
    assert torch.equal(caches[0], caches[1])
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(outs[0], outs[1], atol=tol, rtol=tol), (outs[0] - outs[1]).abs().max()


def test_triton_small_layers_match_torch():
    from shardserve.kernels import triton_ops
    from shardserve.kernels.activation import reference as activation_reference
    from shardserve.kernels.norm import reference as norm_reference
    from shardserve.kernels.rope.reference import rotate_neox
    from shardserve.layers.rotary import RotaryEmbedding
    torch.manual_seed(1)
    dev, dt = "cuda", torch.bfloat16
    x, res = (torch.randn(7, 4096, device=dev, dtype=dt) for _ in range(2))
    w = torch.randn(4096, device=dev, dtype=dt)

    r = res.clone()
    got = triton_ops.rms_norm(x, w, 1e-5, r)
    assert torch.equal(r, x + res)
    want = norm_reference.rms_norm(x + res, w, 1e-5)
    assert (got.float() - want.float()).abs().max() <= 0.02 * got.float().abs().max()
    heads = torch.randn(9, (32 + 4 + 4) * 128, device=dev, dtype=dt)[:, 4096:4608].view(9, 4, 128)   # k in qkv
    wk = torch.randn(128, device=dev, dtype=dt)
    got, want = triton_ops.rms_norm(heads, wk, 1e-6), norm_reference.rms_norm(heads.contiguous(), wk, 1e-6)
    assert got.is_contiguous() and (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()
    gu = torch.randn(5, 2 * 3000, device=dev, dtype=dt) * 3
    want = activation_reference.silu_and_mul(gu)
    assert torch.allclose(triton_ops.silu_and_mul(gu).float(), want.float(), rtol=1e-2, atol=1e-2)
    rope = RotaryEmbedding(128, 4096, 500000.0).to(dev)
    qkv = torch.randn(6, (8 + 2 + 2) * 128, device=dev, dtype=dt)
    q, k = qkv[:, :1024].view(6, 8, 128), qkv[:, 1024:1280].view(6, 2, 128)
    pos = torch.tensor([0, 1, 7, 100, 2000, 4095], device=dev)
    cos, sin = rope.cos[pos].unsqueeze(1).to(dt), rope.sin[pos].unsqueeze(1).to(dt)
    want_q, want_k = rotate_neox(q.clone(), cos, sin), rotate_neox(k.clone(), cos, sin)
    triton_ops.rotary_neox_(pos, q, k, rope.cos, rope.sin)
    # The torch path's bf16 roundings, each product rounded (no fma contraction): the same bits.
    assert torch.equal(q, want_q)
    assert torch.equal(k, want_k)


def test_cuda_graph_decode_gives_the_eager_tokens(tmp_path):
    from shardserve import LLM, SamplingParams
    from tests.tiny_models import make_tiny_checkpoint
    # head_dim 32 (a Triton tile size), fp32 so that only real bugs, not roundings, change tokens.
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2)
    prompts = [[5, 9, 33, 2, 71], [8] * 40, list(range(10, 130))]   # 3 requests: a padded graph batch of 4
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        llm = LLM(path, dtype="float32", device="cuda", gpu_memory_utilization=0.3, max_num_seqs=8,
                  enforce_eager=eager, show_progress=False)
        runner = llm.engine.executor.worker.model_runner
        assert (runner.graphs is None) == eager and runner.backend.name == "cuda-triton"
        runs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runs[eager, "alone"] = llm.generate([prompts[1]], params, use_tqdm=False)[0].outputs[0].token_ids
        llm.engine.shutdown()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert runs[False] == runs[True]
    assert runs[False, "alone"] == runs[False][1] == runs[True, "alone"]


def test_cuda_graph_prefill_gives_the_eager_tokens(tmp_path, monkeypatch):
    """Short prefill-only steps replay graphs (prefill_graphs.py): one request, three at once, a
    prefix-cache hit, and chunked prefills with a context; prompt log-probs cover every row. Tokens
    equal and log-probs within fp32 roundings of the eager run; a 300-token prompt stays eager."""
    from shardserve import LLM, SamplingParams
    from shardserve.worker import prefill_graphs
    from tests.tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2)
    shared = list(range(200, 240))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    hit = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)   # prompt log-probs skip the cache
    batches = [([[5, 9, 33, 2, 71]], params), ([[8] * 40, list(range(10, 130)), [3, 4]], params),
               ([shared + [1, 2, 3]], hit), ([shared + [7] * 20], hit), ([list(range(319, 19, -1))], params)]
    replays = []
    real_run = prefill_graphs.PrefillGraphs.run
    monkeypatch.setattr(prefill_graphs.PrefillGraphs, "run",
                        lambda self, columns, *a: replays.append(columns.shape[1]) or real_run(self, columns, *a))
    runs = {}
    monkeypatch.setenv("SHARDSERVE_PIECEWISE_GRAPHS", "0")   # eager means eager
    for graphs in (True, False):
        monkeypatch.setenv("SHARDSERVE_PREFILL_GRAPHS", "1" if graphs else "0")
        for chunk in (2048, 64):
            before = len(replays)
            llm = LLM(path, dtype="float32", device="cuda", gpu_memory_utilization=0.3, max_num_seqs=8,
                      max_num_batched_tokens=chunk, enable_prefix_caching=True, show_progress=False)
            del replays[before:]   # the start-up warm-up steps (startup_steps.warm_up_mixed_step)
            runner = llm.engine.executor.worker.model_runner
            assert (runner.graphs.prefill is not None) == graphs
            runs[graphs, chunk] = [o for batch, p in batches for o in llm.generate(batch, p, use_tqdm=False)]
            llm.engine.shutdown()
            del llm, runner
            gc.collect()
            torch.cuda.empty_cache()
    # 2048: 5 tokens; 3 requests (162); 43 tokens; 28 after a 32-token prefix hit; the 300 eagerly
    assert replays[:4] == [5, 162, 43, 28] and 300 not in replays
    assert 64 in replays[4:] and len(replays) > 8   # chunks of 64 with a context, every step graphed
    for chunk in (2048, 64):
        for got, want in zip(runs[True, chunk], runs[False, chunk]):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            for g, w in zip((got.prompt_logprobs or [None])[1:] + got.outputs[0].logprobs,
                            (want.prompt_logprobs or [None])[1:] + want.outputs[0].logprobs):
                assert g.keys() == w.keys()
                assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 for t in g)


def test_piecewise_graphs_give_the_eager_tokens(tmp_path, monkeypatch):
    """Steps that mix decodes with prefill chunks, or prefill more requests than a prefill graph
    takes, replay piecewise graphs (piecewise_graphs.py) with attention run between the pieces:
    the eager tokens, and log-probs within fp32 roundings."""
    from shardserve import LLM, SamplingParams
    from shardserve.worker import piecewise_graphs
    from tests.tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 320, (n,), generator=g).tolist() for n in (5, 120, 33, 70, 9, 200, 16)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    replays = []
    real_run = piecewise_graphs.PiecewiseGraphs.run
    monkeypatch.setattr(piecewise_graphs.PiecewiseGraphs, "run",
                        lambda self, columns, *a: replays.append(columns.shape[1]) or real_run(self, columns, *a))
    runs = {}
    for on in ("1", "0"):
        monkeypatch.setenv("SHARDSERVE_PIECEWISE_GRAPHS", on)
        before = len(replays)
        llm = LLM(path, dtype="float32", device="cuda", gpu_memory_utilization=0.3, max_num_seqs=8,
                  max_num_batched_tokens=96, show_progress=False)
        del replays[before:]   # the start-up warm-up steps (startup_steps.warm_up_mixed_step)
        assert (llm.engine.executor.worker.model_runner.graphs.piecewise is not None) == (on == "1")
        runs[on] = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for got, want in zip(runs["1"], runs["0"]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for gl, wl in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert gl.keys() == wl.keys()
            assert all(abs(gl[t].logprob - wl[t].logprob) < 1e-4 for t in gl)
    assert len(replays) >= 4, replays   # prefill chunks beside decodes


def test_triton_prefill_padded_tiles_change_nothing():
    """A prefill graph's tile list, padded to its most tiles and a padding request, gives the bits
    of the exact list."""
    from shardserve.kernels.attention.prefill_tiles import PrefillTiles, max_tiles, tiles_data
    from shardserve.kernels.attention.triton_prefill import paged_prefill_attention
    torch.manual_seed(0)
    dev, bs, pool = torch.device("cuda"), 16, 100
    context, query = [0, 16, 5], [70, 1, 33]
    tables = (torch.randperm(pool - 1)[:3 * 8] + 1).view(3, 8).to(dev, torch.int32)
    cache = torch.randn(2, 2, pool, bs, 64, device=dev, dtype=torch.bfloat16)
    q = torch.randn(sum(query), 8, 64, device=dev, dtype=torch.bfloat16)
    starts = [0, 70, 71]
    outs = []
    for num_tiles, num_reqs in ((None, None), (max_tiles(128, 4), 5)):
        data = tiles_data(starts, query, context, num_tiles, num_reqs)
        padded = torch.zeros(5, 8, dtype=torch.int32, device=dev)
        padded[:3] = tables
        t = PrefillTiles(torch.from_numpy(data).to(dev), num_tiles or 4, num_reqs or 3,
                         tables if num_reqs is None else padded)
        out = torch.full_like(q, float("nan"))
        paged_prefill_attention(q, cache[0], cache[1], t, out, 0.125, None)
        outs.append(out)
    assert max_tiles(128, 4) == 5 and not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(64, 8, 2, None), (128, 32, 8, None), (64, 6, 6, 40)])
@pytest.mark.parametrize("bs", [16, 32])
def test_triton_prefill_matches_torch_reference(dtype, head_dim, heads, kv_heads, window, bs):
    """A ragged step: two decodes, then prefill chunks with and without a cached prefix, shorter and
    longer than a tile, all in one launch against the per-request SDPA oracle."""
    from shardserve.layers.attention.cuda_backend import CudaAttentionBackend
    torch.manual_seed(0)
    dev, pool = torch.device("cuda"), 200
    spec = AttentionSpec(heads, kv_heads, head_dim, head_dim ** -0.5, window)
    context = [40, 7, 0, 0, 16, 100]
    query = [1, 1, 1, 37, 70, 129]
    perm = torch.randperm(pool - 1) + 1
    tables, used = torch.zeros(len(context), 17, dtype=torch.int32), 0
    slots = []
    for i, (c, n) in enumerate(zip(context, query)):
        nb = -(-(c + n) // bs)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(c, c + n)]
    common = CommonAttentionMetadata(2, query, context, tables.to(dev), torch.tensor(slots, device=dev), bs)
    cache = torch.randn(2, kv_heads, pool, bs, head_dim, device=dev).to(dtype)
    cache[:, :, 0] = 0
    t = sum(query)
    q = torch.randn(t, heads, head_dim, device=dev).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, device=dev).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, device=dev).to(dtype)
    outs = []
    for backend in (TorchAttentionBackend(), CudaAttentionBackend()):
        outs.append(backend.forward(spec, q, k, v, cache.clone(), backend.build(common, dev)).float())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(outs[0], outs[1], atol=tol, rtol=tol), (outs[0] - outs[1]).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 8, 2), (128, 32, 8), (64, 12, 3)])
def test_rotary_fused_with_kv_write_matches_separate_kernels(dtype, head_dim, heads, kv_heads):
    """One kernel (rotate q and k, store k and v) against the rotary kernel then the K/V write, and
    both against torch's rotation (head counts not a power of two too: masked head tiles)."""
    from shardserve.kernels.attention.triton_decode import write_kv
    from shardserve.kernels.rope.reference import rotate_neox
    from shardserve.kernels.rope.triton_rope import rotary_neox_
    from shardserve.layers.attention.cuda_backend import CudaAttentionBackend
    from shardserve.layers.rotary import RotaryEmbedding
    torch.manual_seed(3)
    dev, bs, pool, t = torch.device("cuda"), 16, 40, 9
    rope = RotaryEmbedding(head_dim, 4096, 500000.0).to(dev)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=dev).to(dtype)
    cache = torch.zeros(2, kv_heads, pool, bs, head_dim, device=dev, dtype=dtype)
    positions = torch.tensor([0, 1, 15, 16, 17, 300, 1000, 2047, 4095], device=dev)
    slots = torch.randperm((pool - 1) * bs, device=dev)[:t] + bs

    def views(x):
        q, k, v = x.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), v.reshape(t, kv_heads, head_dim)

    want_qkv, want_cache = qkv.clone(), cache.clone()
    q, k, v = views(want_qkv)
    cos, sin = rope.cos[positions].unsqueeze(1).to(dtype), rope.sin[positions].unsqueeze(1).to(dtype)
    torch_q, torch_k = rotate_neox(q.clone(), cos, sin), rotate_neox(k.clone(), cos, sin)
    rotary_neox_(positions, q, k, rope.cos, rope.sin)
    assert torch.equal(q, torch_q) and torch.equal(k, torch_k)
    write_kv(k, v, want_cache[0], want_cache[1], slots)
    got_qkv, got_cache = qkv.clone(), cache.clone()
    q, k, v = views(got_qkv)
    backend = CudaAttentionBackend()
    assert backend.fuses_rotary(q, k, v)
    tables = torch.arange(1, 2, dtype=torch.int32, device=dev).view(1, 1)
    md = backend.build(CommonAttentionMetadata(0, [t], [0], tables, slots, bs), dev)
    backend._write(q, k, v, got_cache[0], got_cache[1], md, (positions, rope.cos, rope.sin))
    assert torch.equal(got_qkv, want_qkv)
    assert torch.equal(got_cache, want_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(64, 8, 2, None), (128, 32, 8, None), (64, 6, 6, 40)])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_decode_with_rotary_inside_matches_separate_kernels(dtype, head_dim, heads, kv_heads, window, splits,
                                                            monkeypatch):
    """A decode-only step with the rotation and the K/V store inside the attention kernel gives the
    bits of the rotary + K/V write kernel followed by the attention kernel: output and pool."""
    from shardserve.kernels.attention import triton_decode
    from shardserve.layers.attention import cuda_backend
    from shardserve.layers.rotary import RotaryEmbedding
    if splits is not None:
        monkeypatch.setattr(triton_decode, "num_splits", lambda *a: splits)
    torch.manual_seed(4)
    dev, bs, pool = torch.device("cuda"), 16, 200
    spec = AttentionSpec(heads, kv_heads, head_dim, head_dim ** -0.5, window)
    lens = [0, 15, 16, 100, 333, 2000]   # context before the new token (its position)
    common = _scattered_decodes(lens, bs, pool, dev)
    cache = torch.randn(2, kv_heads, pool, bs, head_dim, device=dev).to(dtype)
    cache[:, :, 0] = 0
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, device=dev).to(dtype)
    rope = RotaryEmbedding(head_dim, 4096, 500000.0).to(dev)
    rotary = (torch.tensor(lens, device=dev), rope.cos, rope.sin)
    outs, caches = [], []
    for inside in (False, True):
        monkeypatch.setattr(cuda_backend, "ROPE_IN_DECODE", inside)
        x, c = qkv.clone(), cache.clone()
        q, k, v = x.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.reshape(-1, kv_heads, head_dim)
        backend = cuda_backend.CudaAttentionBackend()
        assert backend.fuses_rotary(q, k, v)
        outs.append(backend.forward(spec, q, k, v, c, backend.build(common, dev), rotary))
        caches.append(c)
    assert torch.equal(caches[0], caches[1])
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n,k,gated,bias", [(6144, 4096, False, False), (1000, 896, False, True),
                                            (4096, 14336, False, False), (3000, 1024, True, False)])
def test_triton_gemv_matches_cublas(rows, n, k, gated, bias):
    """The skinny-matmul kernel against F.linear (and SiLU-and-mul for the gated form): the same
    result up to the order of an fp32 sum, i.e. within a bf16 ulp or two of the output."""
    import torch.nn.functional as F

    from shardserve.kernels.gemv import triton_gemv
    torch.manual_seed(rows)
    dev, dt = "cuda", torch.bfloat16
    w = torch.randn(2 * n if gated else n, k, device=dev, dtype=dt) * 0.03
    b = torch.randn(n, device=dev, dtype=dt) if bias else None
    x = torch.randn(rows, k, device=dev, dtype=dt)
    assert triton_gemv.handles(x, w)
    want = F.linear(x, w, b)
    if gated:
        want = F.silu(want[:, :n].float()).to(dt).float() * want[:, n:].float()
    got = triton_gemv.gemv(x, w, b, gated=gated)
    assert got.shape == (rows, n)
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2), (got.float() - want.float()).abs().max()
    assert not triton_gemv.handles(torch.randn(17, k, device=dev, dtype=dt), w)   # more rows: cuBLAS


@pytest.mark.parametrize("rows,n", [(1, 128256), (3, 151936), (16, 2049), (2, 1000)])
def test_triton_argmax_is_torch_argmax(rows, n):
    """Greedy sampling's chunked argmax: the same index as torch.argmax, ties (coarse values repeat
    the maximum many times) going to the first, and rows of -inf included."""
    from shardserve.kernels.argmax import triton_argmax
    from shardserve.layers.sampler import Sampler, SamplingMetadata
    torch.manual_seed(n)
    for dt in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, n, device="cuda").to(dt)
        coarse = torch.randint(0, 5, (rows, n), device="cuda").to(dt)   # the maximum repeats
        flat = torch.full((rows, n), float("-inf"), device="cuda", dtype=dt)
        for logits in (x, coarse, flat, x[:, : n - 7]):   # the last one: strided rows
            assert torch.equal(triton_argmax.argmax_rows(logits), logits.float().argmax(dim=-1))
    md = SamplingMetadata(temperature=None, greedy=None, all_greedy=True)
    tokens, lp = Sampler()(x, md)
    assert lp is None and torch.equal(tokens, x.float().argmax(dim=-1))
