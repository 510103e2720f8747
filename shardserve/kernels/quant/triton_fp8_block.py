"""FP8 (E4M3) weights with block-wise scales (a multiplier per block of BN output rows x BK inputs,
as Qwen3-*-FP8 and DeepSeek-V3 store them: `weight_block_size`, `weight_scale_inv`), in Triton for
CUDA. quantization/fp8_block.py keeps the weight E4M3 [N, K] and the scales compact: `scales`
[R, ceil(K / BK)] fp32 and `scale_row` int32 [N], the scale row of each output row (a lookup rather
than row // BN, so fused parts and tensor-parallel shards need not start on a block boundary).

- "runs" (1-4 rows, a decode batch): kernels/quant/triton_fp8_gemv.py's "runs" kernel with block
  scales (its BK: a step's K range cut into 8 runs of C inputs on the tensor cores, the tile's
  columns runs x rows, each run's product multiplied by its rows' scales for that run's block
  before it is kept; C divides BK, so a run lies in one block). Split-K for layers with few output
  strips.
- "dot" (more rows): output tiles of BLOCK_N features x BLOCK_M rows over a 2-D grid, fp16 tensor-core
  products of BLOCK_K inputs a step (dividing BK), each step's product scaled the same way: one
  tile of 16 rows for a decode batch, wider tiles for short prefill chunks where `scaled_mm`
  cannot run (the weight read once per tile of rows, never widened in memory).
- `scaled_mm` (prefill chunks, where the layer allows): cuBLAS's block-scaled FP8 matmul through
  `torch._scaled_mm` (Hopper, CUDA 12.9+; 128 x 128 weight blocks, K a multiple of 128), the
  activations quantized per token and 128 inputs first (DeepSeek-V3's recipe, W8A8 on the FP8
  tensor cores). `scaled_mm_works` tries it once per GPU.
- `dequantize`: the whole weight into bf16/fp16 (q * s in fp32, rounded once: the values the
  16-bit path loads), for cuBLAS on the largest row counts where `scaled_mm` cannot run.
The Triton kernels widen the weights to fp16 exactly and keep the activations 16-bit (W8A16: no
per-token rounding); bf16 activations are clamped to fp16's range on the way, as the per-channel
kernels do.
The gated forms compute silu(x Wg^T) * (x Wu^T) for a stacked gate_up weight in one pass.
"""
from __future__ import annotations

import functools
import logging

import torch

from shardserve.kernels import pdl
from shardserve.kernels.quant import splitk, triton_fp8_gemv, triton_fp8_quant
from shardserve.utils import cdiv

logger = logging.getLogger("shardserve")

RUNS_ROWS = 4    # the runs loop: up to 4 rows (32 columns)
MAX_ROWS = 16    # a decode batch: one tile of 16 rows
DOT_ROWS = 256   # the dot loop up to here; more rows: dequantize, then cuBLAS (H100: faster past ~256)

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    @triton.jit
    def fp8_block_dot_kernel(x_ptr, w_ptr, s_ptr, srow_ptr, b_ptr, out_ptr, rows, n, k, stride_x, stride_w, stride_s,
                             stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             BK: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w + kk[None, :]
        w_up = w_ptr + (n + cols[:, None]).to(tl.int64) * stride_w + kk[None, :]
        s_rows, s_up = triton_fp8_gemv.block_scale_rows(s_ptr, srow_ptr, stride_s, cols, col_ok, n, GATED)
        y = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        y_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        x_rows = x_ptr + m[None, :].to(tl.int64) * stride_x
        for k0 in range(0, k, BLOCK_K):
            k_ok = (k0 + kk) < k
            x = tl.load(x_rows + (k0 + kk)[:, None], mask=(m[None, :] < rows) & k_ok[:, None], other=0.0)   # [K, M]
            x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
            w = tl.load(w_rows + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            s = tl.load(s_rows + k0 // BK, mask=col_ok, other=0.0)
            y += tl.dot(w.to(tl.float16), x) * s[:, None]
            if GATED:
                w_u = tl.load(w_up + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                s_u = tl.load(s_up + k0 // BK, mask=col_ok, other=0.0)
                y_up += tl.dot(w_u.to(tl.float16), x) * s_u[:, None]
        splitk.finish(y, y_up, out_ptr, b_ptr, cols, col_ok, m, rows, stride_o, HAS_BIAS, GATED)

    @triton.jit
    def fp8_block_dequantize_kernel(w_ptr, s_ptr, srow_ptr, out_ptr, n, k, stride_s, BK: tl.constexpr,
                                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        col_ok = cols < n
        ok = col_ok[:, None] & (kk < k)[None, :]
        offs = cols[:, None].to(tl.int64) * k + kk[None, :]
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        srow = tl.load(srow_ptr + cols, mask=col_ok, other=0)
        s = tl.load(s_ptr + srow[:, None] * stride_s + (kk // BK)[None, :], mask=ok, other=0.0)
        tl.store(out_ptr + offs, (w * s).to(out_ptr.dtype.element_ty), mask=ok)


def run_length(block_k: int, default: int = 128) -> int | None:
    """The runs loop's C for blocks of `block_k` inputs: at most `default`, dividing block_k, 16 or
    more (a tensor-core product's depth); None where no such length exists."""
    c = min(default, block_k)
    return c if c >= 16 and block_k % c == 0 and c & (c - 1) == 0 else None


def handles(x: torch.Tensor, weight: torch.Tensor, block_k: int) -> bool:
    """A CUDA bf16/fp16 activation of 1-DOT_ROWS rows against a contiguous E4M3 weight whose blocks
    the kernels can walk (see run_length); more rows: `dequantize` and cuBLAS."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= DOT_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(-1) == 1 and weight.dtype == torch.float8_e4m3fn and weight.is_contiguous()
            and run_length(block_k) is not None)


def default_tiles(rows: int, gated: bool, block_k: int) -> tuple:
    """The fastest or near it on the 8B shapes on an H100 (benchmarks/fp8_block.py --sweep)."""
    run = run_length(block_k)
    if rows <= 2:
        return "runs", 16, run, 1, 3, 1
    if rows <= RUNS_ROWS and not gated:
        return "runs", 32, run, 2, 3, 1
    if rows <= MAX_ROWS:
        return "dot", 16, 32, run, 4, 4
    return "dot", 64, 64, run, 4, 4


def matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, scale_row: torch.Tensor, block_k: int,
           bias: torch.Tensor | None = None, gated: bool = False, tiles: tuple | None = None) -> torch.Tensor:
    """x [rows, K] @ W^T (+ bias), W[i, j] = weight[i, j] * scales[scale_row[i], j // block_k];
    gated: weight and scale_row stack gate then up rows ([2 * n, K], [2 * n]) and the result is
    silu(gate) * up [rows, n]. tiles: ("runs", BLOCK_N, C, warps, stages, SPLIT) (up to 4 rows) or
    ("dot", BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); default by row count."""
    if gated and bias is not None:
        raise ValueError("the gated form takes no bias")
    rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    tiles = tiles or default_tiles(rows, gated, block_k)
    if tiles[0] == "runs":
        _, block_n, run, warps, stages, split = tiles
        if block_k % run:
            raise ValueError(f"a run of {run} inputs must divide the scale blocks' {block_k}")
        return triton_fp8_gemv.runs(x, weight, scales, bias, gated, n, block_n, run, warps, stages, split,
                                    scale_row=scale_row, block_k=block_k)
    _, block_m, block_n, step, warps, stages = tiles
    if block_k % step:
        raise ValueError(f"a step of {step} inputs must divide the scale blocks' {block_k}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    fp8_block_dot_kernel[(cdiv(n, block_n), cdiv(rows, block_m))](
        x, weight, scales, scale_row, bias if bias is not None else scales, out, rows, n, k, x.stride(0),
        weight.stride(0), scales.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=step,
        BK=block_k, HAS_BIAS=bias is not None, GATED=gated, num_warps=warps, num_stages=stages,
        **pdl.launch_args(x))
    return out


def dequantize(weight: torch.Tensor, scales: torch.Tensor, scale_row: torch.Tensor, block_k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype`: weight * its block's scale in fp32, rounded once."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    block_n, block_kk = 32, 128
    fp8_block_dequantize_kernel[(cdiv(n, block_n), cdiv(k, block_kk))](
        weight, scales, scale_row, out, n, k, scales.stride(0), BK=block_k, BLOCK_N=block_n, BLOCK_K=block_kk,
        num_warps=4, **pdl.launch_args(weight))
    return out


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, grid: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (K a multiple of 128) @ W^T (+ bias) on cuBLAS's block-scaled FP8 matmul: W's 128 x 128
    blocks scaled by grid [N / 128, K / 128] (fp32, K / 128 a multiple of 4), x quantized per token
    and 128 inputs."""
    xq, x_scales = triton_fp8_quant.quantize_token_groups(x, 128)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scales, scale_b=grid.t(), out_dtype=x.dtype)[:x.shape[0]]
    return out + bias if bias is not None else out


@functools.cache
def scaled_mm_works(device_index: int) -> bool:
    """Whether this GPU, torch and cuBLAS run `scaled_mm` (Hopper with CUDA 12.9+), and right: one
    small product against the dequantized reference."""
    device = torch.device("cuda", device_index)
    try:
        x = torch.randn(5, 512, device=device, dtype=torch.bfloat16)
        w = torch.randn(256, 512, device=device).to(torch.float8_e4m3fn)
        grid = torch.rand(2, 4, device=device) + 0.5
        dense = w.float() * grid.repeat_interleave(128, 0).repeat_interleave(128, 1)
        want = torch.nn.functional.linear(x.float(), dense)
        err = ((scaled_mm(x, w, grid).float() - want).norm() / want.norm()).item()
    except (RuntimeError, NotImplementedError, ValueError) as e:
        logger.info("block-scaled FP8: torch._scaled_mm with 128 x 128 blocks does not run here (%s); prefill "
                    "dequantizes each weight for cuBLAS", str(e).splitlines()[0][:200])
        return False
    if err > 0.1:
        logger.warning("block-scaled FP8: torch._scaled_mm with 128 x 128 blocks is %.3f off; not used", err)
    return err <= 0.1
