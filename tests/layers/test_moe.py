"""The MoE layer's parts on the CPU: routing as HF does it, the grouped torch experts against the
plain-torch reference (uneven routing, idle experts, picks held by other EP ranks), the expert
weight loader for per-expert and stacked checkpoint tensors, and the expert-load debug log."""
from __future__ import annotations

import pytest
import torch

from shardserve.kernels.moe import reference, torch_moe
from shardserve.layers.moe import FusedMoE, expert_load_report


def _weights(experts: int, hidden: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1,
            torch.randn(experts, hidden, inter, generator=gen) * 0.1)


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_hf_qwen3_moe(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(9, 32)
    out = router(x)
    hf_weights, hf_ids = out[-2], out[-1]   # (logits, weights, ids) or (weights, ids)
    weights, ids = reference.route_topk(x @ router.weight.t(), 4, renormalize)
    assert torch.equal(ids.long(), hf_ids.long())
    torch.testing.assert_close(weights, hf_weights.float())


@pytest.mark.parametrize("case", ["random", "one_expert", "idle_experts", "other_ranks", "top1"])
def test_grouped_experts_match_reference(case):
    experts, hidden, inter, tokens, top_k = 8, 48, 40, 37, 2
    w13, w2 = _weights(experts, hidden, inter)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    if case == "one_expert":     # every token's first pick is expert 3
        ids[:, 0] = 3
        ids[:, 1] = torch.where(ids[:, 1] == 3, 4, ids[:, 1])
    elif case == "idle_experts":  # experts 0-5 get nothing
        ids = torch.stack([torch.full((tokens,), 6), torch.full((tokens,), 7)], 1).int()
    elif case == "other_ranks":   # expert parallelism: picks of experts on other ranks are -1
        ids[::3, 1] = -1
        ids[::5, 0] = -1
    elif case == "top1":
        ids, top_k = ids[:, :1].contiguous(), 1
    weights = torch.rand(tokens, top_k, generator=gen)
    expected = reference.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(torch_moe.fused_moe(x, w13, w2, weights, ids), expected, atol=1e-5, rtol=1e-5)
    if case == "other_ranks":   # a token whose picks are all elsewhere gets exactly zero
        both = ((ids == -1).all(dim=1)).nonzero().flatten()
        assert both.numel() and expected[both].abs().max() == 0


def test_expert_weight_loader_per_expert_and_stacked():
    experts, hidden, inter = 4, 16, 12
    w13, w2 = _weights(experts, hidden, inter)
    gate, up = w13[:, :inter], w13[:, inter:]
    per_expert = FusedMoE(experts, 2, hidden, inter, renormalize=True)
    for e in range(experts):
        per_expert.weight_loader(per_expert.w13_weight, gate[e], (e, "gate"))
        per_expert.weight_loader(per_expert.w13_weight, up[e], (e, "up"))
        per_expert.weight_loader(per_expert.w2_weight, w2[e], (e, "down"))
    stacked = FusedMoE(experts, 2, hidden, inter, renormalize=True)
    stacked.weight_loader(stacked.w13_weight, w13, (None, "gate_up"))   # transformers 5's fused layout
    stacked.weight_loader(stacked.w2_weight, w2, (None, "down"))
    for layer in (per_expert, stacked):
        assert torch.equal(layer.w13_weight, w13) and torch.equal(layer.w2_weight, w2)
    with pytest.raises(ValueError, match="unknown expert weight kind"):
        stacked.weight_loader(stacked.w2_weight, w2[0], (0, "w9"))


def test_expert_load_log(monkeypatch, caplog):
    monkeypatch.setenv("SHARDSERVE_EXPERT_LOAD", "1")
    layer = FusedMoE(4, 1, 8, 6, renormalize=False)
    torch.nn.init.normal_(layer.w13_weight)
    torch.nn.init.normal_(layer.w2_weight)
    logits = torch.tensor([[0.0, 9.0, 0.0, 0.0]] * 3 + [[0.0, 0.0, 0.0, 9.0]])   # expert 1 x3, expert 3 x1
    layer(torch.randn(4, 8), logits)
    line = expert_load_report(layer)
    assert line is not None and "3.00" in line and "[0, 3, 0, 1]" in line   # busiest 3 tokens vs mean 1
    assert expert_load_report(layer) is None   # counts were reset
    monkeypatch.delenv("SHARDSERVE_EXPERT_LOAD")
    assert FusedMoE(4, 1, 8, 6, renormalize=False).load is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_experts_match_reference(dtype):
    """The CPU default path: expert matrices packed per expert for the native GEMM (bf16 panels for a
    bf16 checkpoint, fp32 for fp32), fp32 math."""
    from shardserve.kernels.cpu import cpu_ops
    if not cpu_ops.available():
        pytest.skip("the native CPU kernels are not built here (no compiler or not x86)")
    experts, hidden, inter, tokens = 6, 40, 24, 19   # widths that are not multiples of 16
    w13, w2 = (w.to(dtype).float() for w in _weights(experts, hidden, inter))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)]).int()
    ids[::4, 1] = -1
    weights = torch.rand(tokens, 2, generator=gen)
    p13, p2 = cpu_ops.pack_experts(w13, dtype), cpu_ops.pack_experts(w2, dtype)
    assert p13.dtype == dtype and p13.logical_shape == (experts, 2 * inter, hidden)
    torch.testing.assert_close(torch_moe.fused_moe(x, p13, p2, weights, ids),
                               reference.fused_moe(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)
