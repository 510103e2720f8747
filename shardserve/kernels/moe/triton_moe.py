"""Fused mixture-of-experts for CUDA in Triton: the oracle's semantics (kernels/moe/reference.py) in four
launches and no host sync, so a decode step can be captured in a CUDA graph.

1. align (align.py): the T * K picks grouped by expert, each group padded to BLOCK_M rows;
2. gate_up: one grouped matmul per BLOCK_M block, A = hidden rows (pick // K), B = that block's
   expert's w13; each program holds a gate tile and the matching up tile, so SiLU-and-mul happens in
   registers on the fp32 accumulators and only [T * K, I] is written;
3. down: A = those [T * K, I] rows, B = w2[expert], scaled by the pick's routing weight in the
   epilogue, written to [T * K, H] at the pick's own row;
4. sum over the K picks of each token in fp32, skipping picks with id -1 (their rows are never written).

FP8 experts: w13 / w2 in float8_e4m3fn with an fp32 scale per output row of each expert, or with
block-wise scales (`reference.BlockScales`: one per block of output rows x SCALE_BLOCK_K inputs,
Qwen3-*-FP8's experts; the K loop then steps inside one block of inputs at a time and scales each
step's product by its columns' scales for that block before adding it).
- Few picks per expert (decode; up to W8A16_PICKS_PER_EXPERT on average): weight-only (W8A16). The
  kernel loads the E4M3 tile (half the bytes of bf16: what a decode step is bound by) and widens it
  in registers (exact) to fp16 for the tensor-core dot, bf16 activations clamped to fp16's range;
  row scales multiply the fp32 accumulators in the epilogue (gate and up each by their own, before
  the SiLU-and-mul).
- More (prefill): W8A8. Each matmul's activations are quantized first, a scale per row and ACT_GROUP
  inputs (kernels/quant/triton_fp8_quant.py, as DeepSeek-V3's recipe and the dense block-FP8 layers
  do), and the dots run on FP8 tensor cores, each step's product times its rows' activation scales.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os

import torch

from shardserve.kernels.moe.align import moe_align
from shardserve.kernels.moe.reference import BlockScales
from shardserve.kernels.quant import triton_fp8_quant

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    @triton.jit
    def moe_step(acc, a, b, a_scale, b_scale, SCALE_MODE: tl.constexpr, PRECISION: tl.constexpr):
        """acc + a @ b for one K step. SCALE_MODE 0: b widened to a's dtype in registers (exact for
        E4M3; a no-op for 16-bit experts), accumulated in the tensor cores; 1: the same, the step's
        product times b_scale (the columns' block scales for this step: [1, BLOCK_N], or one for the
        whole tile). FP8 activations (a in E4M3, a_scale [BLOCK_M] for this step's group of inputs):
        an FP8 dot, its product times the rows' scales (2: and b_scale; 3: row-scaled weights, whose
        scales come in the epilogue)."""
        if SCALE_MODE == 1:
            return acc + tl.dot(a, b.to(a.dtype), input_precision=PRECISION) * b_scale
        elif SCALE_MODE == 2:
            return acc + tl.dot(a, b) * (a_scale[:, None] * b_scale)
        elif SCALE_MODE == 3:
            return acc + tl.dot(a, b) * a_scale[:, None]
        else:
            return tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)

    @triton.jit
    def block_tile(pid, num_programs, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(M block, N tile) of program pid: programs run M-block groups of GROUP_M at a time over
        all N tiles, so the blocks of one expert (which share its B) are in flight together and B
        comes from L2 more often."""
        num_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        group_rows = min(num_programs // num_n - first_m, GROUP_M)
        return first_m + (pid % width) % group_rows, (pid % width) // group_rows

    @triton.jit
    def block_scales(s_rows, kb, TILE_SCALE: tl.constexpr):
        """This step's block scales of the tile's columns: [1, BLOCK_N] gathered through each column's
        scale row, or (TILE_SCALE: every column of the tile shares one scale row) one scalar."""
        if TILE_SCALE:
            return tl.load(s_rows + kb)
        else:
            return tl.load(s_rows + kb)[None, :]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_valid"])
    def moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, s_ptr, srow_ptr, as_ptr, sorted_ptr, expert_ptr, total_ptr,
                        N, K, num_valid, stride_am, stride_be, stride_bn, stride_cm, stride_se, stride_sr, stride_as,
                        A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
                        B_SCALED: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, TILE_SCALE: tl.constexpr,
                        SCALE_MODE: tl.constexpr,
                        FP16_DOT: tl.constexpr, A_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
        pid_m, pid_n = block_tile(tl.program_id(0), tl.num_programs(0), N, BLOCK_N, GROUP_M)
        # The grid is sized for the worst routing; blocks past this batch's padded length do nothing.
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return

        sid = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = sid < num_valid
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        rows = (sid // A_DIV).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        # Both operands have K innermost; B is read as [BLOCK_K, BLOCK_N] (w rows are output columns).
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
        up_shift = N * stride_bn  # GATED: the up rows sit I rows below the gate rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Block scales: each output column's scale row (one scale per SCALE_BLOCK_K inputs), or the tile's
        # first column's where the whole tile shares it.
        s_gate = s_ptr
        s_up = s_ptr
        if SCALE_BLOCK_K > 0:
            s_base = s_ptr + expert * stride_se
            if TILE_SCALE:
                s_gate = s_base + tl.load(srow_ptr + pid_n * BLOCK_N).to(tl.int64) * stride_sr
                if GATED:
                    s_up = s_base + tl.load(srow_ptr + N + pid_n * BLOCK_N).to(tl.int64) * stride_sr
            else:
                s_gate = s_base + tl.load(srow_ptr + offs_n, mask=n_ok, other=0).to(tl.int64) * stride_sr
                if GATED:
                    s_up = s_base + tl.load(srow_ptr + N + offs_n, mask=n_ok, other=0).to(tl.int64) * stride_sr
        for k0 in range(0, K, BLOCK_K):
            # A mask along K would stop 16-byte loads, so it is left out when K divides evenly.
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < K - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP16_DOT:   # bf16 activations clamped to fp16's range, for fp16 dots (moe_gemm says why)
                a = tl.clamp(a.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
            b_scale = 1.0
            if SCALE_BLOCK_K > 0:   # BLOCK_K divides SCALE_BLOCK_K
                b_scale = block_scales(s_gate, k0 // SCALE_BLOCK_K, TILE_SCALE)
            a_scale = 1.0
            if A_GROUP > 0:   # FP8 activations: this step's group's scale of each row (BLOCK_K divides A_GROUP)
                a_scale = tl.load(as_ptr + rows + (k0 // A_GROUP) * stride_as, mask=row_ok, other=0.0)
            # PRECISION: fp32 in full ("ieee", not tf32)
            acc = moe_step(acc, a, b, a_scale, b_scale, SCALE_MODE, PRECISION)
            if GATED:
                if EVEN_K:
                    bu = tl.load(b_ptrs + up_shift, mask=n_ok[None, :], other=0.0)
                else:
                    bu = tl.load(b_ptrs + up_shift, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if SCALE_BLOCK_K > 0:
                    b_scale = block_scales(s_up, k0 // SCALE_BLOCK_K, TILE_SCALE)
                acc_up = moe_step(acc_up, a, bu, a_scale, b_scale, SCALE_MODE, PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K

        if B_SCALED:   # per-row scales of this expert's weight (gate rows, then up rows N further)
            s_row = s_ptr + expert * stride_se + offs_n
            acc = acc * tl.load(s_row, mask=n_ok, other=0.0)[None, :]
            if GATED:
                acc_up = acc_up * tl.load(s_row + N, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if MUL_WEIGHT:
            acc = acc * tl.load(w_ptr + sid, mask=row_ok, other=0.0)[:, None]
        c_ptrs = c_ptr + sid.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit
    def sum_picks_kernel(y_ptr, ids_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            # (h * 0 +: a vector mask; Triton's interpreter, which CI runs this under, takes no scalar one)
            here = h * 0 + tl.load(ids_ptr + t * TOP_K + k) >= 0
            acc += tl.load(y_ptr + (t * TOP_K + k) * H + h, mask=h_ok & here, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)

    return triton, moe_gemm_kernel, sum_picks_kernel


# FP8 experts with more than this many picks per expert on average take FP8 activations (W8A8): at
# Qwen3-30B-A3B's shapes on an H200 (benchmarks/moe_fp8.py) equal to W8A16 at 4 picks, 1.3x faster at 32.
W8A16_PICKS_PER_EXPERT = 8
ACT_GROUP = 128   # FP8 activations: one scale per row and this many inputs (block-FP8's 1 x 128)


def w8a8(picks: int, experts: int) -> bool:
    return picks > W8A16_PICKS_PER_EXPERT * experts


def config_file_name(num_experts: int, inter_size: int, device_name: str) -> str:
    return f"E={num_experts},N={inter_size},device_name={device_name.replace(' ', '_')}.json"


@functools.cache
def _device_name() -> str:
    return torch.cuda.get_device_name()


@functools.cache
def _load_configs(name: str) -> dict[int, dict] | None:
    path = os.path.join(CONFIG_DIR, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return {int(m): cfg for m, cfg in json.load(f).items()}


def default_config(num_tokens: int, num_experts: int, top_k: int) -> dict:
    """Tiles by how many rows an expert gets on average: decode streams weights (small BLOCK_M, wide
    BLOCK_K, many programs); prefill is a real matmul (large tiles, L2-friendly grouping)."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 8:
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    if per_expert <= 32:
        return dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=3)
    if per_expert <= 96:
        return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=3,
                    down=dict(BLOCK_SIZE_N=128))
    return dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3,
                down=dict(BLOCK_SIZE_N=128))


def get_config(num_experts: int, inter_size: int, hidden_size: int, num_tokens: int,
               dtype: torch.dtype = torch.bfloat16, device_name: str | None = None, top_k: int = 2) -> dict:
    """Tiles for a batch of `num_tokens`: from configs/E=..,N=..,device_name=...json (written by
    benchmarks/tune_moe.py; the entry for the nearest batch size) or else default_config. A config is
    {BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages} for gate_up and,
    optionally, "down": the keys that differ for the down projection (BLOCK_SIZE_M is shared: both
    matmuls walk the same grouping). hidden_size and dtype (16-bit floats share tiles) do not pick the
    file but are part of the question."""
    del hidden_size, dtype
    if device_name is None:
        device_name = _device_name() if torch.cuda.is_available() else "cpu"
    table = _load_configs(config_file_name(num_experts, inter_size, device_name))
    if not table:
        return default_config(num_tokens, num_experts, top_k)
    return table[min(table, key=lambda m: (abs(m - num_tokens), m))]


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed (the MoE kernels of this package and its siblings need it)."""
    return importlib.util.find_spec("triton") is not None


def handles(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | BlockScales | None = None) -> bool:
    """True where this kernel can run: CUDA tensors, bf16/fp16 activations with experts of the same dtype
    or FP8 (E4M3) with their row scales or block scales (blocks of a power of two >= 16 inputs), fp32
    with fp32 experts (full-precision products: a model run in fp32 on CUDA, whose CUDA graphs the
    host-synced torch path would break), and Triton installed."""
    blocks_ok = not isinstance(w13_scale, BlockScales) or (
        w13_scale.block_k >= 16 and w13_scale.block_k & (w13_scale.block_k - 1) == 0)
    fp8 = (w13.dtype == torch.float8_e4m3fn and w13_scale is not None and hidden.dtype != torch.float32
           and blocks_ok)
    return (hidden.is_cuda and w13.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (w13.dtype == hidden.dtype or fp8) and triton_available())


def moe_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor | None,
             sorted_ids: torch.Tensor, expert_ids: torch.Tensor, total: torch.Tensor, a_div: int, gated: bool,
             cfg: dict, b_scale: torch.Tensor | BlockScales | None = None,
             a_scale: torch.Tensor | None = None) -> None:
    """c[pick] = (act)(a[pick // a_div] @ b[expert].T) (* weights[pick]) for every pick in `sorted_ids`.
    gated: b holds 2 * N rows (gate then up) and c gets silu(gate) * up, N = c's width.
    b_scale: fp32 [E, rows of b] scales of FP8 weights, applied to the accumulators, or their block
    scales, applied to each step. a_scale: `a` is E4M3 with these fp32 scales per row and group of
    ACT_GROUP inputs (triton_fp8_quant.quantize_token_groups' layout): FP8 dots (FP8 experts only)."""
    triton, gemm, _ = _kernels()
    n, k = c.shape[1], b.shape[2]
    assert a.stride(-1) == 1 and b.stride(-1) == 1 and c.stride(-1) == 1, "K and N must be innermost"
    # FP8 experts against 16-bit activations (W8A16: decode, few rows per expert): E4M3 widens to fp16
    # in one instruction per two weights (bf16 takes three), so bf16 activations are clamped to fp16
    # for the dot (benchmarks/moe_fp8.py: 1.2-1.3x faster at 1-64 tokens).
    fp16_dot = b.dtype == torch.float8_e4m3fn and a.dtype == torch.bfloat16 and cfg.get("FP16_DOT", True)
    block_k, scale_rows, scale_mode, step, tile_scale = 0, c, 0, cfg["BLOCK_SIZE_K"], False   # (c: never read)
    if isinstance(b_scale, BlockScales):   # each step inside one block of inputs, a whole one by default
        block_k, scale_rows, tile_rows = b_scale.block_k, b_scale.scale_row, b_scale.uniform_rows
        b_scale, tile_scale = b_scale.scales, tile_rows % cfg["BLOCK_SIZE_N"] == 0 and cfg.get("TILE_SCALE", True)
        scale_mode, step = 1, min(cfg.get("BLOCK_SIZE_K_BLOCKS", block_k), block_k)
        assert scale_rows.dtype == torch.int32 and b_scale.dim() == 3
    if a_scale is not None:   # FP8 activations: each step inside one group of inputs, a whole one by default
        assert a.dtype == torch.float8_e4m3fn and b.dtype == a.dtype and a_scale.stride(0) == 1
        scale_mode, fp16_dot = (2 if block_k else 3), False
        step = min(cfg.get("BLOCK_SIZE_K_BLOCKS", ACT_GROUP), block_k or ACT_GROUP, ACT_GROUP)
    cfg = {**cfg, "BLOCK_SIZE_K": step}
    assert b_scale is None or (b_scale.dtype == torch.float32 and b_scale.stride(-1) == 1)
    grid = (expert_ids.numel() * triton.cdiv(n, cfg["BLOCK_SIZE_N"]),)
    gemm[grid](a, b, c, weights if weights is not None else c, b_scale if b_scale is not None else c, scale_rows,
               a_scale if a_scale is not None else c, sorted_ids, expert_ids, total, n, k, c.shape[0], a.stride(0),
               b.stride(0), b.stride(1), c.stride(0), b_scale.stride(0) if b_scale is not None else 0,
               b_scale.stride(1) if block_k else 0, a_scale.stride(1) if a_scale is not None else 0,
               A_DIV=a_div, GATED=gated, MUL_WEIGHT=weights is not None, EVEN_K=k % cfg["BLOCK_SIZE_K"] == 0,
               B_SCALED=b_scale is not None and not block_k, SCALE_BLOCK_K=block_k, TILE_SCALE=tile_scale,
               SCALE_MODE=scale_mode, FP16_DOT=fp16_dot, A_GROUP=ACT_GROUP if a_scale is not None else 0,
               BLOCK_M=cfg["BLOCK_SIZE_M"],
               BLOCK_N=cfg["BLOCK_SIZE_N"], BLOCK_K=cfg["BLOCK_SIZE_K"], GROUP_M=cfg["GROUP_SIZE_M"],
               num_warps=cfg["num_warps"],
               # fp32 tiles take twice the shared memory of the 16-bit ones the configs are tuned for
               num_stages=min(cfg["num_stages"], 2) if a.dtype == torch.float32 else cfg["num_stages"],
               PRECISION="ieee" if a.dtype == torch.float32 else "tf32")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict | None = None, w13_scale: torch.Tensor | BlockScales | None = None,
              w2_scale: torch.Tensor | BlockScales | None = None) -> torch.Tensor:
    """hidden [T, H] -> [T, H], as reference.fused_moe (see it for the layouts, FP8 experts with their
    row or block scales too). `config` overrides the tuned tiles (get_config's format); the tuner passes it."""
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    cfg = config or get_config(num_experts, inter, hidden_size, num_tokens, hidden.dtype, top_k=top_k)
    down_cfg = {**cfg, **cfg.get("down", {})}
    triton, _, sum_picks = _kernels()
    topk_ids = topk_ids.contiguous()
    sorted_ids, expert_ids, total = moe_align(topk_ids, num_experts, cfg["BLOCK_SIZE_M"])
    h = hidden.contiguous()
    # Many rows per expert: FP8 experts take FP8 activations (a scale per row and ACT_GROUP inputs), so
    # the dots run on FP8 tensor cores with nothing widened (W8A8, as the dense FP8 layers prefill).
    fp8_acts = w13.dtype == torch.float8_e4m3fn and cfg.get("W8A8", w8a8(num_tokens * top_k, num_experts))
    act = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    a, a_scale = triton_fp8_quant.quantize_token_groups(h, ACT_GROUP) if fp8_acts else (h, None)
    moe_gemm(a, w13, act, None, sorted_ids, expert_ids, total, top_k, True, cfg, w13_scale, a_scale)
    y = torch.empty(num_tokens * top_k, hidden_size, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).to(torch.float32)
    a, a_scale = triton_fp8_quant.quantize_token_groups(act, ACT_GROUP) if fp8_acts else (act, None)
    moe_gemm(a, w2, y, weights, sorted_ids, expert_ids, total, 1, False, down_cfg, w2_scale, a_scale)
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    sum_picks[(num_tokens, triton.cdiv(hidden_size, block_h))](y, topk_ids, out, hidden_size, TOP_K=top_k,
                                                               BLOCK_H=block_h, num_warps=4)
    return out
