"""A GGUF linear's matmul on CUDA, over the runs of output rows its weight is held in (one run per
GGUF type; kernels/quant/gguf_layout.py `gpu_weight`): Q4_0, Q4_1 and Q4_K runs on the W4A16
kernels (kernels/quant/triton_w4a16_gemv.py, triton_w4a16.py; a 4-bit gate_up on their gated
form), the other kept types on the planes kernels (kernels/quant/triton_gguf.py), a run of a type
not kept as the dense rows it was dequantized to at load (the bf16 GEMV or cuBLAS); past
triton_gguf.GEMV_ROWS rows the kept runs are dequantized for cuBLAS."""
from __future__ import annotations

import torch

from shardserve.kernels.gemv import triton_gemv
from shardserve.kernels.quant import reference, triton_gguf, triton_w4a16, triton_w4a16_gemv, tuned
from shardserve.kernels.quant.gguf_layout import GgufPlanes, Int4Weight

Run = GgufPlanes | Int4Weight | torch.Tensor   # a run's weight: kept in blocks, or dense rows [n, K]


def _dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A run dequantized at load: its rows [n, K] of x's dtype."""
    return triton_gemv.gemv(x, w, bias) if triton_gemv.handles(x, w) else torch.nn.functional.linear(x, w, bias)


def _int4(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """A 4-bit run on the W4A16 kernels (gguf_layout.gpu_weight), x [rows <= triton_gguf.GEMV_ROWS, K]."""
    args = w.args()
    if x.dtype == torch.float32:   # the W4A16 kernels take bf16 / fp16 activations
        return torch.nn.functional.linear(x, reference.int4_weight(*args, dtype=x.dtype), bias)
    if x.shape[0] <= triton_w4a16_gemv.MAX_ROWS:
        return triton_w4a16_gemv.gemv(x, *args, bias=bias)
    return triton_w4a16.matmul_dot(x, *args, bias=bias)


def gated(x: torch.Tensor, parts: list[tuple[slice, Run]], layer) -> torch.Tensor | None:
    """silu(x Wg^T) * (x Wu^T) in one W4A16 GEMV for a merged gate/up held as one 4-bit run, 1 to
    triton_w4a16_gemv.MAX_ROWS bf16/fp16 rows on CUDA; None elsewhere (then matmul + SiLU-and-mul)."""
    sizes = layer.output_shard_sizes
    if (len(parts) != 1 or not isinstance(parts[0][1], Int4Weight) or len(sizes) != 2 or sizes[0] != sizes[1]
            or not tuned.ENABLED or not x.is_cuda or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16)
            or not 0 < x.shape[0] <= triton_w4a16_gemv.MAX_ROWS):
        return None
    return triton_w4a16_gemv.gemv(x if x.stride(-1) == 1 else x.contiguous(), *parts[0][1].args(), gated=True)


def matmul(x: torch.Tensor, parts: list[tuple[slice, Run]], n: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] @ W^T (+ bias) for a weight [n, K] held as runs of output rows, each of one GGUF
    type (a fused q/k/v or gate/up whose parts differ in type has several): the GEMVs up to
    triton_gguf.GEMV_ROWS rows, else the weight dequantized for cuBLAS."""
    rows, k = x.shape[0], x.shape[1]
    if rows > triton_gguf.GEMV_ROWS:
        w = torch.empty(n, k, dtype=x.dtype, device=x.device)
        for at, part in parts:
            if isinstance(part, torch.Tensor):
                w[at] = part
            elif isinstance(part, Int4Weight):
                w[at] = triton_w4a16.dequantize(*part.args(), dtype=x.dtype)
            else:
                triton_gguf.dequantize(part, x.dtype, out=w[at])
        return torch.nn.functional.linear(x, w, bias)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    for at, part in parts if rows else ():
        part_bias = None if bias is None else bias[at]
        if isinstance(part, torch.Tensor):
            out[:, at] = _dense(x, part if part.dtype == x.dtype else part.to(x.dtype), part_bias)
        elif isinstance(part, Int4Weight):
            out[:, at] = _int4(x, part, part_bias)
        else:
            triton_gguf.gemv(x, part, part_bias, out=out[:, at])
    return out
