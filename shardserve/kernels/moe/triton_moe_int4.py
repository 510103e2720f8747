"""The fused MoE kernel for INT4 (GPTQ / AWQ) experts on CUDA: triton_moe.py's four launches (align, gate_up,
down, sum of picks) with B read as 4-bit words (kernels/moe/int4_experts.py's layout) and dequantized in
registers; activations bf16 / fp16, accumulation fp32, no host sync (CUDA graphs replay it).

Per [BLOCK_K, BLOCK_N] tile of an expert's weight the program loads the [BLOCK_K / 8, BLOCK_N] int32
words once and spreads each over its 8 inputs in registers (shift, mask). Then, two ways:
- regular groups (no activation order) and a BLOCK_K that divides the group size and this rank's
  phase (where TP cut a group): the block lies inside one group, so (q - zero), exact in bf16 / fp16,
  goes to the tensor-core dot as it is and the group's scale row multiplies the block's fp32 partial
  sums: one scale and one zero per output per block (BLOCK_K is lowered, to 16 at least, to fit);
- otherwise (GPTQ `desc_act`, blocks straddling groups): each input's group from `group_index`, its
  scale and zero gathered per input, (q - zero) * scale in fp32 rounded once to the activations'
  dtype (as int4_experts.Int4Experts.dequantize), then the dot.
Tiles: the bf16 kernel's defaults per batch size (triton_moe.default_config), not tuned for INT4.

Decode (few picks: `VEC_PICKS` or fewer token-expert pairs) takes a vector kernel instead: one
program per (pick, strip of BLOCK_N outputs), no sorting by expert and no tensor cores. The kernel
above pads every expert's one or two rows to a 16-row tile and, at groups of 32 (GGUF), steps through
K 32 inputs at a time with a 16-byte load per output row; the vector kernel reads BLOCK_K / 2
contiguous bytes per row per step, multiplies q by x in fp32, sums per group (`SUB` inputs) and
applies each group's scale and zero (or min) to those sums: s (sum q x - z sum x), or s sum q x -
m sum x. It needs regular groups that SUB divides (GPTQ without `desc_act`, AWQ, GGUF).
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
                             N, K, num_valid, group, phase, stride_am, stride_qe, stride_qn, stride_se, stride_sg,
                             stride_ge, stride_cm,
                             A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, ALIGNED: tl.constexpr, MINS: tl.constexpr):
        pid_m, pid_n = triton_moe.block_tile(tl.program_id(0), tl.num_programs(0), N, BLOCK_N, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return

        sid = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = sid < num_valid
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        rows = (sid // A_DIV).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        offs_w = tl.arange(0, BLOCK_K // 8)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        # Words [E, rows, K / 8]: input k of row n is nibble k % 8 of word k // 8. The [BLOCK_K / 8,
        # BLOCK_N] words are loaded once and each spread over its 8 inputs in registers.
        q_ptrs = q_ptr + expert * stride_qe + offs_n[None, :].to(tl.int64) * stride_qn + offs_w[:, None]
        shifts = (tl.arange(0, 8) * 4)[None, :, None]
        s_base = s_ptr + expert * stride_se + offs_n[None, :]
        z_base = z_ptr + expert * stride_se + offs_n[None, :]
        g_ptrs = g_ptr + expert * stride_ge + offs_k
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)   # 0 past K: those q add 0
            wk_ok = (offs_w * 8 < K - k0)[:, None] & n_ok[None, :]
            q = tl.reshape((tl.load(q_ptrs, mask=wk_ok, other=0)[:, None, :] >> shifts) & 15, (BLOCK_K, BLOCK_N))
            if GATED:   # the up rows sit N rows below the gate rows, in the words and the scales alike
                q_up = tl.reshape((tl.load(q_ptrs + N * stride_qn, mask=wk_ok, other=0)[:, None, :] >> shifts) & 15,
                                  (BLOCK_K, BLOCK_N))
            if ALIGNED:
                # The block lies inside one group: (q - zero) is exact in bf16 / fp16, so the dot takes
                # it as it is and the group's scale multiplies the block's fp32 partial sums. Mins
                # (fp16 "zeros": w = q s - m): the dot takes q, and m times each row's sum of the
                # block's activations comes off.
                g_off = ((k0 + phase) // group) * stride_sg
                s = tl.load(s_base + g_off, mask=n_ok[None, :], other=0.0).to(tl.float32)
                if MINS:
                    a_sum = tl.sum(a.to(tl.float32), axis=1)[:, None]
                    m = tl.load(z_base + g_off, mask=n_ok[None, :], other=0.0).to(tl.float32)
                    acc += tl.dot(a, q.to(a.dtype)) * s - a_sum * m
                else:
                    z = tl.load(z_base + g_off, mask=n_ok[None, :], other=0).to(tl.int32)
                    acc += tl.dot(a, (q - z).to(a.dtype)) * s
                if GATED:
                    s = tl.load(s_base + N + g_off, mask=n_ok[None, :], other=0.0).to(tl.float32)
                    if MINS:
                        m = tl.load(z_base + N + g_off, mask=n_ok[None, :], other=0.0).to(tl.float32)
                        acc_up += tl.dot(a, q_up.to(a.dtype)) * s - a_sum * m
                    else:
                        z = tl.load(z_base + N + g_off, mask=n_ok[None, :], other=0).to(tl.int32)
                        acc_up += tl.dot(a, (q_up - z).to(a.dtype)) * s
            else:
                # Any input's group (activation order, groups a block straddles): scale and zero
                # gathered per input, the weight dequantized in fp32 and rounded once.
                bk_ok = k_ok[:, None] & n_ok[None, :]
                g = tl.load(g_ptrs, mask=k_ok, other=0).to(tl.int64)[:, None] * stride_sg
                s = tl.load(s_base + g, mask=bk_ok, other=0.0).to(tl.float32)
                if MINS:   # q s - m
                    w = q.to(tl.float32) * s - tl.load(z_base + g, mask=bk_ok, other=0.0).to(tl.float32)
                else:
                    w = (q - tl.load(z_base + g, mask=bk_ok, other=0).to(tl.int32)).to(tl.float32) * s
                acc = tl.dot(a, w.to(a.dtype), acc)
                if GATED:
                    s = tl.load(s_base + N + g, mask=bk_ok, other=0.0).to(tl.float32)
                    if MINS:
                        w = q_up.to(tl.float32) * s - tl.load(z_base + N + g, mask=bk_ok, other=0.0).to(tl.float32)
                    else:
                        w = (q_up - tl.load(z_base + N + g, mask=bk_ok, other=0).to(tl.int32)).to(tl.float32) * s
                    acc_up = tl.dot(a, w.to(a.dtype), acc_up)
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


VEC_PICKS = 128  # token-expert pairs up to which the vector kernel runs (benchmarks/gguf_gpu.py --moe)
VEC_TILES = (8, 256, 2, 4)   # the vector kernel's BLOCK_N, BLOCK_K, warps, pipeline stages


@functools.cache
def _vec_kernel():
    import triton.language as tl
    from triton import jit

    @jit(do_not_specialize=["stride_sn"])
    def moe_int4_vec_kernel(a_ptr, q_ptr, s_ptr, z_ptr, ids_ptr, c_ptr, w_ptr, N, K, group, phase, stride_am,
                            stride_qe, stride_qn, stride_se, stride_sg, stride_sn, stride_cm,
                            A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, MINS: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr):
        pick = tl.program_id(0)   # token * top_k + j; w13 reads token pick // top_k (A_DIV), w2 row pick
        expert = tl.load(ids_ptr + pick).to(tl.int64)
        if expert < 0:            # another expert-parallel rank's: sum_picks skips it
            return
        # The words are held as [BLOCK_N outputs, NSUB groups, WPS words of a group] (4 words, 16 bytes,
        # per thread: SUB 32), never reshaped (a reshape goes through shared memory): nibble i of every
        # word is taken in turn against the inputs 8w + i, and each group's sums come from the thread's
        # own words. Only those [BLOCK_N, NSUB] sums meet the scales' layout.
        NSUB: tl.constexpr = BLOCK_K // SUB
        WPS: tl.constexpr = SUB // 8
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n3 = offs_n[:, None, None]
        sub3 = tl.arange(0, NSUB)[None, :, None]
        word = sub3 * WPS + tl.arange(0, WPS)[None, None, :]        # [1, NSUB, WPS]
        a_row = a_ptr + (pick // A_DIV).to(tl.int64) * stride_am + word * 8
        q_rows = q_ptr + expert * stride_qe + n3.to(tl.int64) * stride_qn + word
        sub = tl.arange(0, NSUB)[None, :]
        n_ok = (offs_n < N)[:, None]
        # stride_sn (1) is left unspecialized: seen as contiguous along the outputs, the scales' loads
        # would choose their own register layout and the sums would move to it through shared memory
        # every step (8 barriers against 1; no time measured either way on the H100).
        s_base = s_ptr + expert * stride_se + offs_n[:, None] * stride_sn
        z_base = z_ptr + expert * stride_se + offs_n[:, None] * stride_sn
        acc = tl.zeros((BLOCK_N, NSUB), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, NSUB), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w_ok = (n3 < N) & (word * 8 < K - k0)
            words = tl.load(q_rows + k0 // 8, mask=w_ok, other=0)
            if GATED:   # the up rows sit N rows below the gate rows, in the words and the scales alike
                words_up = tl.load(q_rows + N * stride_qn + k0 // 8, mask=w_ok, other=0)
            dots = tl.zeros((BLOCK_N, NSUB, WPS), dtype=tl.float32)
            dots_up = tl.zeros((BLOCK_N, NSUB, WPS), dtype=tl.float32)
            x_sums = tl.zeros((1, NSUB, WPS), dtype=tl.float32)
            for i in tl.static_range(8):
                x = tl.load(a_row + k0 + i, mask=word * 8 + i < K - k0, other=0.0).to(tl.float32)
                x_sums += x
                dots += ((words >> (4 * i)) & 15).to(tl.float32) * x
                if GATED:
                    dots_up += ((words_up >> (4 * i)) & 15).to(tl.float32) * x
            x_sum = tl.sum(x_sums, axis=2)                               # [1, NSUB]
            # one scale and zero (or min) per output and group
            g = ((k0 + phase + sub * SUB) // group) * stride_sg
            g_ok = n_ok & (sub * SUB < K - k0)
            s = tl.load(s_base + g, mask=g_ok, other=0.0).to(tl.float32)
            z = tl.load(z_base + g, mask=g_ok, other=0).to(tl.float32)
            if MINS:    # q s - m
                acc += s * tl.sum(dots, axis=2) - z * x_sum
            else:       # (q - z) s
                acc += s * (tl.sum(dots, axis=2) - z * x_sum)
            if GATED:
                s = tl.load(s_base + N * stride_sn + g, mask=g_ok, other=0.0).to(tl.float32)
                z = tl.load(z_base + N * stride_sn + g, mask=g_ok, other=0).to(tl.float32)
                if MINS:
                    acc_up += s * tl.sum(dots_up, axis=2) - z * x_sum
                else:
                    acc_up += s * (tl.sum(dots_up, axis=2) - z * x_sum)
        out = tl.sum(acc, axis=1)
        if GATED:
            out = out / (1.0 + tl.exp(-out)) * tl.sum(acc_up, axis=1)
        if MUL_WEIGHT:
            out = out * tl.load(w_ptr + pick)
        tl.store(c_ptr + pick.to(tl.int64) * stride_cm + offs_n, out.to(c_ptr.dtype.element_ty), mask=offs_n < N)

    return moe_int4_vec_kernel


def _vec_sub(b: Int4Experts) -> int:
    """The inputs the vector kernel sums under one scale: a power of two that divides the group and
    this rank's phase, 32 at most (4 words a thread), 8 at least (0: irregular groups, the vector
    kernel cannot run)."""
    if not b.group_size:
        return 0
    sub = 32
    while sub > 8 and (b.group_size % sub or b.group_phase % sub):
        sub //= 2
    return sub if sub >= 8 else 0


def moe_int4_vec(a: torch.Tensor, b: Int4Experts, c: torch.Tensor, weights: torch.Tensor | None,
                 topk_ids: torch.Tensor, a_div: int, gated: bool) -> None:
    """c[pick] = (act)(a[pick // a_div] @ b[topk_ids.flat[pick]].T) (* weights[pick]) for every pick,
    by the vector kernel (module docstring); picks of expert -1 are left unwritten."""
    import triton
    n, k = c.shape[1], b.shape[2]
    assert a.stride(-1) == 1 and c.stride(-1) == 1 and b.qweight.stride(-1) == 1
    assert b.scales.stride() == b.zeros.stride()
    block_n, block_k, warps, stages = VEC_TILES
    grid = (c.shape[0], triton.cdiv(n, block_n))
    _vec_kernel()[grid](a, b.qweight, b.scales, b.zeros, topk_ids, c, weights if weights is not None else c, n, k,
                        b.group_size, b.group_phase, a.stride(0), b.qweight.stride(0), b.qweight.stride(1),
                        b.scales.stride(0), b.scales.stride(1), b.scales.stride(2), c.stride(0), A_DIV=a_div,
                        GATED=gated,
                        MUL_WEIGHT=weights is not None, MINS=b.zeros.dtype == torch.float16, BLOCK_N=block_n,
                        BLOCK_K=block_k, SUB=_vec_sub(b), num_warps=warps, num_stages=stages)


def handles(hidden: torch.Tensor, w13: Int4Experts) -> bool:
    """CUDA tensors, bf16 / fp16 activations, Triton installed."""
    return (hidden.is_cuda and w13.qweight.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
            and triton_moe.triton_available())


def _block_k(b: Int4Experts, block_k: int, aligned: bool) -> tuple[int, bool]:
    """(BLOCK_K, whether every block lies inside one group): halved from the tile's BLOCK_K (down to
    16) until it divides the group size and this rank's phase, where the groups are regular."""
    if not aligned or not b.group_size:
        return block_k, False
    while block_k > 16 and (b.group_size % block_k or b.group_phase % block_k):
        block_k //= 2
    return block_k, b.group_size % block_k == 0 and b.group_phase % block_k == 0


def moe_int4_gemm(a: torch.Tensor, b: Int4Experts, c: torch.Tensor, weights: torch.Tensor | None,
                  sorted_ids: torch.Tensor, expert_ids: torch.Tensor, total: torch.Tensor, a_div: int, gated: bool,
                  cfg: dict) -> None:
    """triton_moe.moe_gemm with INT4 experts: c[pick] = (act)(a[pick // a_div] @ b[expert].T) (* weight).
    cfg["ALIGNED_GROUPS"] (default True) False forces the per-input group lookup (tests, timings)."""
    import triton
    n, k = c.shape[1], b.shape[2]
    assert a.stride(-1) == 1 and c.stride(-1) == 1 and b.qweight.stride(-1) == 1
    assert b.scales.stride() == b.zeros.stride() and b.group_index.stride(-1) == 1
    block_k = max(16, min(cfg["BLOCK_SIZE_K"], triton.next_power_of_2(k)))
    block_k, aligned = _block_k(b, block_k, cfg.get("ALIGNED_GROUPS", True))
    grid = (expert_ids.numel() * triton.cdiv(n, cfg["BLOCK_SIZE_N"]),)
    _kernel()[grid](a, b.qweight, b.scales, b.zeros, b.group_index, c, weights if weights is not None else c,
                    sorted_ids, expert_ids, total, n, k, c.shape[0], b.group_size or 1, b.group_phase, a.stride(0),
                    b.qweight.stride(0), b.qweight.stride(1), b.scales.stride(0), b.scales.stride(1),
                    b.group_index.stride(0), c.stride(0),
                    A_DIV=a_div, GATED=gated, MUL_WEIGHT=weights is not None, BLOCK_M=cfg["BLOCK_SIZE_M"],
                    BLOCK_N=cfg["BLOCK_SIZE_N"], BLOCK_K=block_k, GROUP_M=cfg["GROUP_SIZE_M"], ALIGNED=aligned,
                    MINS=b.zeros.dtype == torch.float16, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def fused_moe(hidden: torch.Tensor, w13: Int4Experts, w2: Int4Experts, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """hidden [T, H] -> [T, H], as triton_moe.fused_moe with INT4 experts (int4_experts.py's layout).
    config["VEC"] (True / False) overrides the choice of the vector kernel (tests, timings)."""
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
    act = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    y = torch.empty(num_tokens * top_k, hidden_size, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).to(torch.float32)
    if cfg.get("VEC", num_tokens * top_k <= VEC_PICKS) and _vec_sub(w13) and _vec_sub(w2):
        moe_int4_vec(hidden.contiguous(), w13, act, None, topk_ids, top_k, True)
        moe_int4_vec(act, w2, y, weights, topk_ids, 1, False)
    else:
        sorted_ids, expert_ids, total = moe_align(topk_ids, num_experts, cfg["BLOCK_SIZE_M"])
        moe_int4_gemm(hidden.contiguous(), w13, act, None, sorted_ids, expert_ids, total, top_k, True, cfg)
        moe_int4_gemm(act, w2, y, weights, sorted_ids, expert_ids, total, 1, False, down_cfg)
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    sum_picks[(num_tokens, triton.cdiv(hidden_size, block_h))](y, topk_ids, out, hidden_size, TOP_K=top_k,
                                                               BLOCK_H=block_h, num_warps=4)
    return out
