"""Top-k routing in one Triton kernel on CUDA: what reference.route_topk does in five or six torch
kernels (fp32 cast, softmax, top-k, sum, division, int32 cast), one program per token.

At batch 1 a MoE step is bound by its kernels' launch and tail latency more than by bytes (a
48-layer Qwen3-30B-A3B runs ~90 us a layer, a third of it in the experts; BENCHMARKS.md, session
20), so each launch saved per layer counts. The picks are chosen on the logits themselves (softmax
is monotonic, so the same experts as top-k of the probabilities, without exp's rounding making two
near logits tie), in descending order as torch.topk returns them, the lower index first among equal
logits; the weights are the softmax's (fp32) and, with `renormalize`, rescaled to sum to 1. No host
sync: CUDA graphs replay it.
"""
from __future__ import annotations

import functools

import torch

MAX_EXPERTS = 4096   # one program holds a token's logits in registers


@functools.cache
def _kernel():
    import triton.language as tl
    from triton import jit

    @jit
    def route_topk_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_t, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                          RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        ok = offs < E
        x = tl.load(logits_ptr + t * stride_t + offs, mask=ok, other=float("-inf")).to(tl.float32)
        # NaN ranks above everything, as in torch.topk (the weights come out NaN, as torch's do): the
        # picks stay real experts whatever the logits, never an index past them.
        x = tl.where(x != x, float("inf"), x)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        slots = tl.arange(0, K_POW2)
        weights = tl.zeros((K_POW2,), dtype=tl.float32)
        ids = tl.zeros((K_POW2,), dtype=tl.int32)
        free = ok   # experts not picked yet
        for k in tl.static_range(TOP_K):
            best = tl.max(tl.where(free, x, float("-inf")), axis=0)
            pick = tl.min(tl.where(free & (x == best), offs, BLOCK_E), axis=0)   # the lower index among equals
            weights = tl.where(slots == k, tl.sum(tl.where(offs == pick, p, 0.0), axis=0), weights)
            ids = tl.where(slots == k, pick, ids)
            free = free & (offs != pick)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, axis=0)
        keep = slots < TOP_K
        tl.store(w_ptr + t * TOP_K + slots, weights, mask=keep)
        tl.store(ids_ptr + t * TOP_K + slots, ids, mask=keep)

    return route_topk_kernel


def handles(router_logits: torch.Tensor, top_k: int) -> bool:
    from shardserve.kernels.moe import triton_moe
    return (router_logits.is_cuda and router_logits.dim() == 2 and 0 < top_k <= router_logits.shape[1] <= MAX_EXPERTS
            and triton_moe.triton_available())


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As reference.route_topk: (topk_weights fp32 [T, K], topk_ids int32 [T, K])."""
    import triton
    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        block = triton.next_power_of_2(experts)
        _kernel()[(tokens,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
                             K_POW2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, BLOCK_E=block,
                             num_warps=4 if block <= 1024 else 8)
    return weights, ids
