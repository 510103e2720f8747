"""kernels/matmul/triton_skinny.py (the FP8 layers' matmul for decode-sized batches on CUDA) under
Triton's interpreter on the CPU (TRITON_INTERPRET=1, in a subprocess): partial row, column and K
tiles, a bias, the row and column scales, against torch. The interpreter has no FP8 or bf16 dots, so
fp16 stands in; tests/gpu runs it compiled on FP8 against torch._scaled_mm."""
from __future__ import annotations

import torch

from tests.triton_interpreter import run_interpreted


def check_kernel() -> None:
    from shardserve.kernels.matmul import triton_skinny
    torch.manual_seed(0)
    x, w, bias = torch.randn(37, 200).half(), torch.randn(70, 200).half(), torch.randn(70).half()
    want = x.float() @ w.float().t()
    got = triton_skinny.matmul(x, w, bias, tiles=(32, 32, 64, 4, 2))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want + bias.float(), atol=2e-2, rtol=2e-3)
    xs, ws = torch.rand(37, 1) + 0.5, torch.rand(70) + 0.5
    got = triton_skinny.matmul(x, w, None, xs, ws, torch.float32, tiles=(16, 64, 32, 4, 2))
    torch.testing.assert_close(got, want * xs * ws, atol=1e-3, rtol=1e-4)


def test_kernel_under_the_interpreter():
    run_interpreted("tests.layers.test_triton_skinny", "check_kernel")
