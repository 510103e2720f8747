"""kernels/norm/triton_norm.py (CUDA's RMSNorm) under Triton's interpreter on the CPU (TRITON_INTERPRET=1,
in a subprocess) against kernels/norm/reference.py: plain rows with the residual add, and Qwen3's
per-head q / k norms read where the heads lie inside fused qkv rows; tests/gpu runs it compiled."""
from __future__ import annotations

import torch

from tests.triton_interpreter import run_interpreted


def check_kernel() -> None:
    from shardserve.kernels.norm import reference, triton_norm
    torch.manual_seed(0)
    x, res, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    r = res.clone()
    got = triton_norm.rms_norm(x, w, 1e-6, r)
    assert torch.equal(r, x + res)
    torch.testing.assert_close(got, reference.rms_norm(x + res, w, 1e-6))
    qkv = torch.randn(7, (4 + 2 + 2) * 32)   # q: 4 heads of 32, k: 2, v: 2
    q, k = qkv[:, :128].view(7, 4, 32), qkv[:, 128:192].view(7, 2, 32)
    wq, wk = torch.randn(32), torch.randn(32)
    for part, weight in ((q, wq), (k, wk)):
        got = triton_norm.rms_norm(part, weight, 1e-6)
        assert got.shape == part.shape and got.is_contiguous()
        torch.testing.assert_close(got, reference.rms_norm(part.contiguous(), weight, 1e-6))


def test_kernel_under_the_interpreter():
    run_interpreted("tests.layers.test_triton_norm", "check_kernel")
