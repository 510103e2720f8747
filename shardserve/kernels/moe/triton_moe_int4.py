"""The fused MoE kernel for INT4 (GPTQ / AWQ) experts on CUDA: triton_moe.py's four launches (align, gate_up,
down, sum of picks) with B read as 4-bit words (kernels/moe/int4_experts.py's layout) and dequantized in
registers; activations bf16 / fp16, accumulation fp32, no host sync (CUDA graphs replay it).

Per [BLOCK_K, BLOCK_N] tile of an expert's weight the program loads the int32 words holding its inputs
(each word serves 8 consecutive rows of the tile: the same address, so the repeats come from L1),
shifts and masks out the nibbles, looks up each input's group (`group_index`, which also covers GPTQ's
activation order and a TP split that cuts a group), loads that group's zero and scale per output, and
feeds (q - zero) * scale, computed in fp32 and rounded once to the activations' dtype, to the
tensor-core dot: the same values as int4_experts.Int4Experts.dequantize. The scales and zeros are
gathered per input rather than once per group: simpler, and they are 1/8 to 1/16 of the words' bytes.
"""
from __future__ import annotations

import functools

import torch

from shardserve.kernels.moe import triton_moe
from shardserve.kernels.moe.align import moe_align
from shardserve.kernels.moe.int4_experts import Int4Experts


@functools.cache
def _kernel():
    import triton.language as tl
    from triton import jit

    @jit(do_not_specialize=["num_valid"])
    def moe_int4_gemm_kernel(a_ptr, q_ptr, s_ptr, z_ptr, g_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, total_ptr,
                             N, K, num_valid, stride_am, stride_qe, stride_qn, stride_se, stride_sg,
                             stride_ge, stride_cm,
                             A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        num_m = tl.num_programs(0) // num_n
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        group_rows = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % group_rows
        pid_n = (pid % width) // group_rows
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return

        sid = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = sid < num_valid
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        rows = (sid // A_DIV).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        shifts = ((offs_k % 8) * 4)[:, None]
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        # Words [E, rows, K / 8]: input k of row n is nibble k % 8 of word k // 8.
        q_ptrs = q_ptr + expert * stride_qe + offs_n[None, :].to(tl.int64) * stride_qn + (offs_k // 8)[:, None]
        s_base = s_ptr + expert * stride_se + offs_n[None, :]
        z_base = z_ptr + expert * stride_se + offs_n[None, :]
        g_ptrs = g_ptr + expert * stride_ge + offs_k
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            bk_ok = k_ok[:, None] & n_ok[None, :]
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok, other=0).to(tl.int64)[:, None] * stride_sg
            words = tl.load(q_ptrs, mask=bk_ok, other=0)
            s = tl.load(s_base + g, mask=bk_ok, other=0.0).to(tl.float32)
            z = tl.load(z_base + g, mask=bk_ok, other=0).to(tl.int32)
            b = (((words >> shifts) & 15) - z).to(tl.float32) * s
            acc = tl.dot(a, b.to(a.dtype), acc)
            if GATED:   # the up rows sit N rows below the gate rows, in the words and the scales alike
                words = tl.load(q_ptrs + N * stride_qn, mask=bk_ok, other=0)
                s = tl.load(s_base + N + g, mask=bk_ok, other=0.0).to(tl.float32)
                z = tl.load(z_base + N + g, mask=bk_ok, other=0).to(tl.int32)
                b = (((words >> shifts) & 15) - z).to(tl.float32) * s
                acc_up = tl.dot(a, b.to(a.dtype), acc_up)
            a_ptrs += BLOCK_K
            q_ptrs += BLOCK_K // 8
            g_ptrs += BLOCK_K

        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if MUL_WEIGHT:
            acc = acc * tl.load(w_ptr + sid, mask=row_ok, other=0.0)[:, None]
        c_ptrs = c_ptr + sid.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    return moe_int4_gemm_kernel


def handles(hidden: torch.Tensor, w13: Int4Experts) -> bool:
    """CUDA tensors, bf16 / fp16 activations, Triton installed."""
    return (hidden.is_cuda and w13.qweight.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
            and triton_moe._triton_available())


def moe_int4_gemm(a: torch.Tensor, b: Int4Experts, c: torch.Tensor, weights: torch.Tensor | None,
                  sorted_ids: torch.Tensor, expert_ids: torch.Tensor, total: torch.Tensor, a_div: int, gated: bool,
                  cfg: dict) -> None:
    """triton_moe.moe_gemm with INT4 experts: c[pick] = (act)(a[pick // a_div] @ b[expert].T) (* weight)."""
    import triton
    n, k = c.shape[1], b.shape[2]
    assert a.stride(-1) == 1 and c.stride(-1) == 1 and b.qweight.stride(-1) == 1
    assert b.scales.stride() == b.zeros.stride() and b.group_index.stride(-1) == 1
    block_k = max(16, min(cfg["BLOCK_SIZE_K"], triton.next_power_of_2(k)))
    grid = (expert_ids.numel() * triton.cdiv(n, cfg["BLOCK_SIZE_N"]),)
    _kernel()[grid](a, b.qweight, b.scales, b.zeros, b.group_index, c, weights if weights is not None else c,
                    sorted_ids, expert_ids, total, n, k, c.shape[0], a.stride(0), b.qweight.stride(0),
                    b.qweight.stride(1), b.scales.stride(0), b.scales.stride(1), b.group_index.stride(0), c.stride(0),
                    A_DIV=a_div, GATED=gated, MUL_WEIGHT=weights is not None, BLOCK_M=cfg["BLOCK_SIZE_M"],
                    BLOCK_N=cfg["BLOCK_SIZE_N"], BLOCK_K=block_k, GROUP_M=cfg["GROUP_SIZE_M"],
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def fused_moe(hidden: torch.Tensor, w13: Int4Experts, w2: Int4Experts, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """hidden [T, H] -> [T, H], as triton_moe.fused_moe with INT4 experts (int4_experts.py's layout).
    Tiles: the bf16 kernel's defaults for the batch (triton_moe.default_config), not tuned for INT4."""
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    cfg = config or triton_moe.default_config(num_tokens, num_experts, top_k)
    down_cfg = {**cfg, **cfg.get("down", {})}
    triton, _, sum_picks = triton_moe._kernels()
    topk_ids = topk_ids.contiguous()
    sorted_ids, expert_ids, total = moe_align(topk_ids, num_experts, cfg["BLOCK_SIZE_M"])
    act = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    moe_int4_gemm(hidden.contiguous(), w13, act, None, sorted_ids, expert_ids, total, top_k, True, cfg)
    y = torch.empty(num_tokens * top_k, hidden_size, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).to(torch.float32)
    moe_int4_gemm(act, w2, y, weights, sorted_ids, expert_ids, total, 1, False, down_cfg)
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    sum_picks[(num_tokens, triton.cdiv(hidden_size, block_h))](y, topk_ids, out, hidden_size, TOP_K=top_k,
                                                               BLOCK_H=block_h, num_warps=4)
    return out
