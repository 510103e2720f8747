"""W8A8 INT8 matmul for prefill-sized batches on CUDA (quantization/int8.py's kept-INT8 weights):
activations rounded to INT8 per token in one Triton pass (triton_fp8_quant.quantize_tokens), the
INT8 tensor cores through `torch._int_mm` (cuBLASLt, int32 sums), then one Triton pass applying the
token scale, the weight row scale and the bias to the sums and storing the activations' dtype.
Done with torch ops, the rounding and the scaling took ~14 kernels a linear and made INT8 prefill
slower than bf16's."""
from __future__ import annotations

import torch

from shardserve.kernels.quant import triton_fp8_quant

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None


if triton is not None:
    @triton.jit
    def scale_sums_kernel(sums_ptr, xs_ptr, ws_ptr, b_ptr, out_ptr, total, n,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        row, col = i // n, i % n
        y = tl.load(sums_ptr + i, mask=ok, other=0).to(tl.float32)
        y = y * tl.load(xs_ptr + row, mask=ok, other=0.0) * tl.load(ws_ptr + col, mask=ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=ok)


def handles(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._int_mm` takes these shapes (more than 16 rows, K and N multiples of 8)."""
    return (triton is not None and x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 16
            and x.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0)


def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) against the INT8 weight [N, K] with fp32 row scales [N]: the same values
    as quantization/int8.int8_matmul (the same roundings in the same order)."""
    xq, x_scale = triton_fp8_quant.quantize_tokens(x, torch.int8)
    sums = torch._int_mm(xq, weight.t())
    out = torch.empty(sums.shape, dtype=x.dtype, device=x.device)
    total, block = sums.numel(), 1024
    scale_sums_kernel[(triton.cdiv(total, block),)](
        sums, x_scale, scale, bias if bias is not None else scale, out, total, sums.shape[1],
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out
