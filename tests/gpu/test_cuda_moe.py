"""The Triton fused MoE (kernels/moe/triton_moe.py) against the plain-torch oracle computed in fp32:
skewed and empty experts, picks held by other expert-parallel ranks (-1), top-k 1 to 8, odd sizes,
both paths of the grouping step, and replay inside a CUDA graph with new routing."""
from __future__ import annotations

import pytest
import torch

from shardserve.kernels.moe import reference

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("GPU-only: needs CUDA and Triton", allow_module_level=True)


def _weights(num_experts: int, hidden: int, inter: int, dtype=torch.bfloat16):
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda") / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, device="cuda") / inter ** 0.5
    return w13.to(dtype), w2.to(dtype)


def _routing(num_tokens: int, num_experts: int, top_k: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = reference.route_topk(torch.randn(num_tokens, num_experts, device="cuda"), top_k, True)
    if kind == "one_expert":      # every token's picks are the same experts: one run, the rest empty
        ids = torch.arange(num_experts - top_k, num_experts, device="cuda", dtype=torch.int32).repeat(num_tokens, 1)
    elif kind == "few_experts":   # only the first 12 experts get anything
        ids = torch.stack([torch.randperm(12, device="cuda")[:top_k] for _ in range(num_tokens)]).int()
    elif kind == "ep":            # about 40% of picks belong to another rank
        ids = torch.where(torch.rand(ids.shape, device="cuda") < 0.4, -1, ids)
    elif kind == "none_here":
        ids = torch.full_like(ids, -1)
    return weights, ids


def _check(got: torch.Tensor, hidden, w13, w2, weights, ids) -> None:
    want = reference.fused_moe(hidden.float(), w13.float(), w2.float(), weights, ids)
    scale = max(want.abs().max().item(), 1e-3)
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * scale, f"max error {err:.4g} at output scale {scale:.4g}"
    assert got.dtype == hidden.dtype and got.shape == hidden.shape


CASES = [  # tokens, experts, hidden, inter, top_k, routing
    (1, 8, 256, 128, 2, "random"),
    (3, 128, 2048, 768, 8, "random"),          # Qwen3-30B-A3B's shapes at decode
    (7, 16, 384, 192, 1, "random"),
    (64, 8, 256, 384, 2, "one_expert"),
    (64, 8, 512, 256, 1, "one_expert"),
    (100, 32, 256, 128, 4, "ep"),
    (257, 128, 256, 128, 8, "few_experts"),
    (600, 64, 320, 200, 8, "random"),          # sizes not multiples of 128 (nor I of 16); 4800 picks: grid path
    (600, 8, 4096, 1792, 2, "ep"),             # Mixtral-like, 4-way sharded intermediate
    (5, 16, 256, 128, 4, "none_here"),
]


@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k,routing", CASES)
def test_triton_fused_moe_matches_reference(tokens, experts, hidden, inter, top_k, routing):
    from shardserve.kernels.moe import triton_moe
    torch.manual_seed(tokens * 131 + experts)
    w13, w2 = _weights(experts, hidden, inter)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = _routing(tokens, experts, top_k, routing)
    assert triton_moe.handles(x, w13)
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids), x, w13, w2, weights, ids)


@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_triton_fused_moe_any_tile_config(block_m):
    """Every BLOCK_M the tuner may pick, K not a multiple of BLOCK_K, fp16 too."""
    from shardserve.kernels.moe import triton_moe
    torch.manual_seed(block_m)
    cfg = dict(BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=4, num_warps=4, num_stages=2,
               down=dict(BLOCK_SIZE_N=64, BLOCK_SIZE_K=32))
    w13, w2 = _weights(16, 200, 136, torch.float16)
    x = torch.randn(90, 200, device="cuda").to(torch.float16)
    weights, ids = _routing(90, 16, 4, "ep")
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, config=cfg), x, w13, w2, weights, ids)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (7, 60, 4), (300, 8, 2), (33, 128, 8)])
def test_route_kernel_picks_the_reference_experts(tokens, experts, top_k):
    """kernels/moe/triton_route.py against reference.route_topk on the GPU (bf16 and fp32 logits),
    and replayed in a CUDA graph."""
    from shardserve.kernels.moe import triton_route
    torch.manual_seed(tokens)
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(tokens, experts, device="cuda").to(dtype)
        for renormalize in (True, False):
            want_w, want_ids = reference.route_topk(logits, top_k, renormalize)
            got_w, got_ids = triton_route.route_topk(logits, top_k, renormalize)
            # bf16 logits tie now and then: the picks may swap places among equals, never differ in value
            same = torch.equal(got_ids, want_ids) or torch.equal(
                logits.gather(1, got_ids.long()), logits.gather(1, want_ids.long()))
            assert same, (got_ids, want_ids)
            torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = triton_route.route_topk(logits, top_k, True)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    want_w, want_ids = reference.route_topk(logits, top_k, True)
    assert torch.equal(logits.gather(1, ids.long()), logits.gather(1, want_ids.long()))


@pytest.mark.parametrize("tokens", [1, 64, 600])
def test_triton_fused_moe_fp32_in_full_precision(tokens):
    """fp32 models on CUDA run the fused kernel too (the torch path syncs with the host, which CUDA
    graphs cannot capture), with fp32 products, not tf32: near the fp32 reference, far inside tf32's
    ~1e-3 relative rounding."""
    from shardserve.kernels.moe import triton_moe
    torch.manual_seed(tokens)
    w13, w2 = _weights(32, 512, 256, torch.float32)
    x = torch.randn(tokens, 512, device="cuda")
    weights, ids = _routing(tokens, 32, 4, "ep")
    assert triton_moe.handles(x, w13)
    got = triton_moe.fused_moe(x, w13, w2, weights, ids)
    want = reference.fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 2e-5 * want.abs().max().item()


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 8, 128, 16), (9, 2, 8, 64), (700, 8, 128, 32)])
def test_align_groups_picks_by_expert(tokens, top_k, experts, block_m):
    from shardserve.kernels.moe.align import max_padded_len, moe_align
    torch.manual_seed(tokens)
    _, ids = _routing(tokens, experts, top_k, "ep")
    sorted_ids, expert_ids, total = moe_align(ids, experts, block_m)
    numel = ids.numel()
    assert sorted_ids.numel() == max_padded_len(numel, experts, block_m)
    flat, sorted_ids, expert_ids, total = ids.flatten().cpu(), sorted_ids.cpu(), expert_ids.cpu(), int(total)
    pos = 0
    for e in range(experts):
        want = torch.nonzero(flat == e).flatten().tolist()
        run = -(-len(want) // block_m) * block_m
        got = sorted_ids[pos:pos + run]
        assert sorted(got[got < numel].tolist()) == want
        assert int((got == numel).sum()) == run - len(want)
        assert (expert_ids[pos // block_m:(pos + run) // block_m] == e).all()
        pos += run
    assert pos == total


@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_triton_fused_moe_replays_in_cuda_graph(tokens):
    from shardserve.kernels.moe import triton_moe
    torch.manual_seed(tokens)
    experts, hidden, inter, top_k = 64, 512, 256, 4
    w13, w2 = _weights(experts, hidden, inter)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = _routing(tokens, experts, top_k, "random")
    triton_moe.fused_moe(x, w13, w2, weights, ids)          # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.fused_moe(x, w13, w2, weights, ids)
    for kind in ("random", "ep", "one_expert"):
        new_weights, new_ids = _routing(tokens, experts, top_k, kind)
        x.copy_(torch.randn_like(x))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        _check(out.clone(), x, w13, w2, weights, ids)
    del graph


def test_get_config_reads_nearest_batch(tmp_path, monkeypatch):
    from shardserve.kernels.moe import triton_moe
    small = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    big = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3)
    (tmp_path / triton_moe.config_file_name(7, 99, "Some GPU")).write_text(f'{{"1": {small}, "512": {big}}}'
                                                                             .replace("'", '"'))
    monkeypatch.setattr(triton_moe, "CONFIG_DIR", str(tmp_path))
    triton_moe._load_configs.cache_clear()
    try:
        assert triton_moe.get_config(7, 99, 64, 3, device_name="Some GPU") == small
        assert triton_moe.get_config(7, 99, 64, 400, device_name="Some GPU") == big
        assert triton_moe.get_config(7, 100, 64, 3, device_name="Some GPU") == triton_moe.default_config(3, 7, 2)
    finally:
        triton_moe._load_configs.cache_clear()
