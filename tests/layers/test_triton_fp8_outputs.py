"""The RMSNorm and SiLU-and-mul Triton kernels quantizing their own output for an FP8 matmul
(`quantize=True`, handing over Fp8Rows), under Triton's interpreter on the CPU (TRITON_INTERPRET=1,
in a subprocess): bit for bit the separate quantization kernel on the unquantized kernels' output
(its scales also torch's), rows that fit one block and (SiLU-and-mul) rows of several. (The
interpreter's fp32 -> E4M3 conversion rounds some values just under a power of two down a binade,
so the codes are compared with the interpreted kernel, not torch; tests/gpu compares the compiled
kernels with torch bit for bit, in bf16 and inside an FP8 model.)"""
from __future__ import annotations

import torch

from tests.triton_interpreter import run_interpreted


def _assert_rows_equal(got, want_x: torch.Tensor) -> None:
    from shardserve.kernels.quant import triton_fp8_quant
    from shardserve.quantization.fp8 import quantize_tokens
    q, scale = triton_fp8_quant.quantize_tokens(want_x)
    assert got.dtype == want_x.dtype and got.q.shape == q.shape and got.scale.shape == scale.shape
    assert torch.equal(got.scale, scale) and torch.equal(scale, quantize_tokens(want_x)[1])
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))


def check_kernels() -> None:
    from shardserve.kernels.activation import triton_activation
    from shardserve.kernels.norm import triton_norm
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.float32):   # (the interpreter has no bf16 arithmetic)
        x, res, w = (torch.randn(5, 96) * 3).to(dtype), torch.randn(5, 96).to(dtype), torch.randn(96).to(dtype)
        x[1] = -res[1]   # a row of zeros after the residual add
        r = res.clone()
        want_res = x + res
        got = triton_norm.rms_norm(x, w, 1e-6, r, quantize=True)
        assert torch.equal(r, want_res)
        _assert_rows_equal(got, triton_norm.rms_norm(x, w, 1e-6, res.clone()))
        _assert_rows_equal(triton_norm.rms_norm(x, w, 1e-6, quantize=True), triton_norm.rms_norm(x, w, 1e-6))
        for d in (96, triton_activation.ONE_PASS_MAX + 40):   # one block; five, the last partial
            gate_up = (torch.randn(3, 2 * d) * 4).to(dtype)
            _assert_rows_equal(triton_activation.silu_and_mul(gate_up, quantize=True),
                               triton_activation.silu_and_mul(gate_up))


def test_kernels_under_the_interpreter():
    run_interpreted("tests.layers.test_triton_fp8_outputs", "check_kernels")
