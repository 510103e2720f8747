"""kernels/attention/triton_decode.py (CUDA's paged decode attention) under Triton's interpreter on the
CPU (TRITON_INTERPRET=1, in a subprocess) against attention in fp32 torch: ragged lengths through
scattered block tables, one program per (request, KV head) and keys split over programs with the
merge kernel, a 16-bit and an fp8 pool (scales folded in), and the fp8 pool's keys and values widened
to fp16 beside bf16 queries (`f16_kv`). tests/gpu runs the kernel compiled, with the rotary inside."""
from __future__ import annotations

import torch

from tests.triton_interpreter import run_interpreted


def _reference(q, k_pool, v_pool, tables, lens, k_scale, v_scale):
    """Attention of each request's one query over its first lens[b] keys, in fp32."""
    heads, kv_heads, dim = q.shape[1], k_pool.shape[0], q.shape[2]
    block = k_pool.shape[2]
    out = torch.empty(q.shape)
    for b, n in enumerate(lens.tolist()):
        blocks = tables[b, :-(-n // block)].long()
        k = k_pool[:, blocks].reshape(kv_heads, -1, dim)[:, :n].float() * k_scale
        v = v_pool[:, blocks].reshape(kv_heads, -1, dim)[:, :n].float() * v_scale
        k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        scores = torch.einsum("hd,hnd->hn", q[b].float(), k) * dim ** -0.5
        out[b] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v)
    return out


def check_kernel() -> None:
    from shardserve.kernels.attention.triton_decode import paged_decode_attention
    torch.manual_seed(0)
    heads, kv_heads, dim, block, pool_blocks = 8, 2, 32, 16, 48
    lens = torch.tensor([5, 77, 160, 16], dtype=torch.int32)
    tables = (torch.randperm(pool_blocks - 1)[:4 * 10] + 1).int().view(4, 10)
    pool = torch.randn(2, kv_heads, pool_blocks, block, dim) * torch.exp2(torch.randint(-6, 4, (2, kv_heads,
                                                                                              pool_blocks, block, dim)))
    cases = [(torch.float16, torch.float16, 1.0, 1.0, False),
             (torch.float16, torch.float8_e4m3fn, 0.5, 1.7, False),
             (torch.bfloat16, torch.float8_e4m3fn, 0.5, 1.7, True)]   # the interpreter has no bf16 dots: f16 only
    for q_dtype, pool_dtype, k_scale, v_scale, f16_kv in cases:
        cache = pool.to(pool_dtype)
        q = torch.randn(4, heads, dim).to(q_dtype)
        want = _reference(q, cache[0], cache[1], tables, lens, k_scale, v_scale)
        for splits in (1, 3):
            out = torch.empty_like(q)
            paged_decode_attention(q, cache[0], cache[1], tables, lens, out, dim ** -0.5, None, splits=splits,
                                   k_scale=k_scale, v_scale=v_scale, tune={"f16_kv": f16_kv})
            torch.testing.assert_close(out.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2,
                                       msg=f"{q_dtype} queries, {pool_dtype} pool, {splits} splits")


def test_kernel_under_the_interpreter():
    run_interpreted("tests.layers.test_triton_decode", "check_kernel")
