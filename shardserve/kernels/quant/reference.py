"""What the quantized-weight kernels compute, in plain torch: dequantize the weight, then matmul
(cuBLAS on a GPU). The oracle for kernels/quant/triton_fp8_gemv.py, triton_w4a16.py and triton_gguf.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.kernels.quant import gguf_layout, int4_layout


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 [N, K] with fp32 scales [N] -> the weight in `dtype`, computed in fp32 and rounded once."""
    return (weight.float() * scale.float()[:, None]).to(dtype)


def int4_weight(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, group: int, run: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Kernel-layout INT4 (int4_layout.pack) -> the weight [N, K] in `dtype`: (q - z) * s per group
    (fp16 "zeros": mins, q * s - m)."""
    q = int4_layout.unpack(words, k, run)                                   # [K, N]
    g = torch.arange(k, device=words.device) // group
    return int4_layout.values(q, scales.index_select(0, g), zeros.index_select(0, g)).to(dtype).t()


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gated: bool = False) -> torch.Tensor:
    """x @ weight^T (+ bias); gated: silu(gate) * up for a stacked [2 * n, k] weight, the
    intermediate rounded to x's dtype as the unfused path rounds it."""
    y = F.linear(x, weight, bias)
    if not gated:
        return y
    n = weight.shape[0] // 2
    return F.silu(y[..., :n]) * y[..., n:]


def gguf_weight(parts: list[tuple[slice, gguf_layout.GgufPlanes | gguf_layout.Int4Weight | torch.Tensor]], n: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Runs of output rows of GGUF weights as the GPU holds them (gguf_matmul.matmul's argument:
    blocks, or dense rows) -> the weight [n, K] in `dtype`, computed in fp32 and rounded once."""
    first = parts[0][1]
    if isinstance(first, torch.Tensor):
        k, device = first.shape[1], first.device
    else:
        k, device = first.k, next(iter(first.planes.values())).device
    w = torch.empty(n, k, dtype=dtype, device=device)
    for at, part in parts:
        if isinstance(part, torch.Tensor):
            w[at] = part.to(dtype)
        elif isinstance(part, gguf_layout.Int4Weight):
            w[at] = int4_weight(*part.args(), dtype=dtype)
        else:
            w[at] = gguf_layout.dequantize(part).to(dtype)
    return w


def fp8_block_weight(weight: torch.Tensor, scales: torch.Tensor, scale_row: torch.Tensor, block_k: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """E4M3 [N, K] with block scales (kernels/quant/triton_fp8_block.py's layout: `scales` [R, ceil(K /
    block_k)], `scale_row` [N]) -> the weight in `dtype`, computed in fp32 and rounded once."""
    per_input = scales.float().index_select(0, scale_row.long().to(scales.device))
    return (weight.float() * per_input.repeat_interleave(block_k, 1)[:, :weight.shape[1]]).to(dtype)
