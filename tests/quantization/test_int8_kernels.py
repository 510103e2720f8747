"""The W8A8 INT8 prefill kernels (kernels/quant/triton_int8.py: the per-token INT8 rounding of
triton_fp8_quant and the pass applying the scales to `torch._int_mm`'s int32 sums) under Triton's
interpreter on the CPU (TRITON_INTERPRET=1, in a subprocess), bit for bit against the torch ops of
quantization/int8.int8_matmul: rows that fit one block and rows of two passes, ties rounded half to
even, a row of zeros, with and without a bias. (tests/gpu/test_cuda_quant_kernels.py runs them
compiled, at Llama-3-8B shapes.)"""
from __future__ import annotations

import torch

from tests.triton_interpreter import run_interpreted


def check_kernels() -> None:
    from shardserve.kernels.quant import triton_fp8_quant, triton_int8
    from shardserve.quantization.int8 import int8_matmul
    torch.manual_seed(0)
    for k in (200, 8200):   # one pass over the row; two
        x = (torch.randn(20, k) * 3).half()   # (the interpreter has no bf16 arithmetic)
        x[3] = 0
        x[4, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])   # scale 1: ties go to the even integer
        x[4, 4:] = 0
        xq, scale = triton_fp8_quant.quantize_tokens(x, torch.int8)
        want_scale = (x.float().abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
        assert xq.dtype == torch.int8 and torch.equal(scale, want_scale)
        assert torch.equal(xq, (x.float() / want_scale).round().clamp(-127, 127).to(torch.int8))
        assert xq[4, :4].tolist() == [127, 2, -4, 0] and not xq[3].any()
    x = (torch.randn(40, 200) * 2).half()
    w = torch.randint(-127, 128, (24, 200), dtype=torch.int8)
    w_scale = torch.rand(24) * 1e-2 + 1e-3
    for bias in (None, torch.randn(24).half()):
        got = triton_int8.matmul(x, w, w_scale, bias)   # (K 200: the reference's fp32 sums are exact)
        assert got.dtype == x.dtype and torch.equal(got, int8_matmul(x, w, w_scale, bias))


def test_kernels_under_the_interpreter():
    run_interpreted("tests.quantization.test_int8_kernels", "check_kernels")
