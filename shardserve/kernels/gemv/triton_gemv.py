"""Skinny matmuls (a handful of rows, as in a small decode batch) in Triton, for CUDA.

With few rows a linear layer is a pass over its weight: the time is the bytes read. cuBLAS reads
an 8B model's QKV and O weights at batch 1 at 3.1-3.3 TB/s of the H200's ~4.3, and splits K over
programs, which adds a reduction kernel per call. Here each program owns a strip of output
features, streams its rows of the weight once, start to end, and writes finished outputs: one
kernel, no partial sums in memory. The activation rows (up to 16) ride along as one tensor-core
tile (plain FMAs were slower at every shape tried, even for one row). The gated form computes
silu(x Wg^T) * (x Wu^T) for a stacked gate_up weight, so the MLP's activation costs no kernel and
its [rows, 2 * inter] intermediate never reaches memory.

Rounding follows the torch path (fp32 accumulation, bf16 after each op torch does in bf16), so
results agree with cuBLAS's within the last bf16 bit of a sum's reordering.
"""
from __future__ import annotations

import functools
import os

import torch

from shardserve.kernels import pdl
from shardserve.utils import cdiv

MAX_ROWS = 16   # one tensor-core tile of activation rows; larger batches go to cuBLAS
ENABLED = os.environ.get("SHARDSERVE_TRITON_GEMV", "1") != "0"   # off: cuBLAS everywhere (for A/B runs)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    from shardserve.kernels.allreduce.triton_allreduce import exchange_fns
    send_to_peers, sum_with_peers = exchange_fns()

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, rows, n, k, stride_x, stride_w, stride_o, peers_ptr, calls_ptr, rank,
                    HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SEND: tl.constexpr,
                    WORLD: tl.constexpr, SEND_ROWS: tl.constexpr, SEND_HIDDEN: tl.constexpr, REDUCE: tl.constexpr,
                    PDL: tl.constexpr):
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        col_ok = cols < n
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        if SEND:   # the use count picks the exchange slot: loaded now, so the epilogue does not wait for it
            counts = calls_ptr + m
            if REDUCE:   # each program counts its own uses: it alone reads and advances them
                counts += tl.program_id(0) * SEND_ROWS
            call = tl.load(counts, mask=m < rows, other=0)
        for k0 in range(0, k, BLOCK_K):   # k is a multiple of BLOCK_K (checked by the caller)
            x = tl.load(x_ptr + m[None, :] * stride_x + (k0 + kk)[:, None], mask=m[None, :] < rows, other=0.0)
            w = tl.load(w_rows + (k0 + kk)[None, :], mask=col_ok[:, None], other=0.0)
            acc = tl.dot(w, x, acc)
            if GATED:   # the up half's rows sit n rows below the gate's
                w_up = tl.load(w_rows + n * stride_w + (k0 + kk)[None, :], mask=col_ok[:, None], other=0.0)
                acc_up = tl.dot(w_up, x, acc_up)
        dt = out_ptr.dtype.element_ty
        if HAS_BIAS:   # added in fp32 before the one rounding, as cuBLAS's bias epilogue does
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        y = acc.to(dt)
        if GATED:   # as SiluAndMul on the bf16 gate_up output: silu rounded, then the product
            g = y.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            y = (s * acc_up.to(dt).to(tl.float32)).to(dt)
        ok = col_ok[:, None] & (m[None, :] < rows)
        if SEND:   # a TP partial sum: into the peers' all-reduce buffers (distributed/fused_allreduce.py)
            slot = (call % 2)[None, :]
            send_to_peers(y, peers_ptr, rank, m[None, :], slot, cols[:, None], ok, WORLD, SEND_ROWS, SEND_HIDDEN)
            if REDUCE:   # and the finished sum out
                y = sum_with_peers(y, peers_ptr, rank, m[None, :], slot, cols[:, None], ok, WORLD, SEND_ROWS,
                                   SEND_HIDDEN).to(dt)
                tl.store(counts, call + 1, mask=m < rows)
        tl.store(out_ptr + m[None, :] * stride_o + cols[:, None], y, mask=ok)

    return gemv_kernel


def _block_k(k: int, widest: int = 512) -> int | None:
    for block in (512, 256, 128):
        if block <= widest and k % block == 0:
            return block
    return None


def _tiles(n: int, k: int, gated: bool) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K), from a sweep on an H200 over the Llama-3 8B/70B shapes at TP 1 and 2
    (benchmarks/gemv_vs_cublas.py --sweep): wide strips for wide outputs, and a narrower K step
    where a program already streams two weights (gated) or 64 weight rows at once."""
    if n >= 5120:
        return 64, _block_k(k, 128 if gated else 256)
    return 32, _block_k(k, 128 if gated else 512)


def programs(weight: torch.Tensor, gated: bool = False, block_n: int | None = None) -> int:
    """How many programs gemv() runs for this weight (one per strip of output features)."""
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return cdiv(n, block_n or _tiles(n, weight.shape[1], gated)[0])


def handles(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows few enough, a CUDA bf16/fp16 weight, and K tiled evenly (SHARDSERVE_TRITON_GEMV=0: never)."""
    return (ENABLED and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(-1) == 1 and weight.is_contiguous() and _block_k(weight.shape[1]) is not None)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
         send: dict | None = None, block_n: int | None = None, block_k: int | None = None, num_warps: int = 4,
         num_stages: int = 4) -> torch.Tensor:
    """x [rows, K] @ weight[N, K]^T (+ bias); gated: weight is [2 * N, K] (gate rows then up rows)
    and the result is silu(gate) * up, [rows, N]. send: the fused all-reduce's exchange (given by
    AllReduceAddRMSNorm.matmul): the result is also sent to the TP peers, and with REDUCE summed
    with theirs. The tile and pipeline settings default to the tuned ones; the sweep passes others."""
    if (gated or send) and bias is not None:
        raise ValueError("the gated form and a partial sum take no bias")
    rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    tile_n, tile_k = _tiles(n, k, gated)
    block_n, block_k = block_n or tile_n, block_k or tile_k
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (programs(weight, gated, block_n),)
    send = send or dict(peers_ptr=weight, calls_ptr=weight, rank=0, WORLD=1, SEND_ROWS=1, SEND_HIDDEN=1, REDUCE=False)
    _kernel()[grid](x, weight, bias if bias is not None else weight, out, rows, n, k,
                    x.stride(0), weight.stride(0), out.stride(0), **send, SEND=send["WORLD"] > 1,
                    HAS_BIAS=bias is not None, GATED=gated, BLOCK_M=MAX_ROWS, BLOCK_N=block_n,
                    BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages, **pdl.launch_args(x))
    return out
