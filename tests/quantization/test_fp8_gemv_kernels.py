"""The per-channel FP8 decode GEMV (kernels/quant/triton_fp8_gemv.py) under Triton's interpreter on the
CPU (TRITON_INTERPRET=1, in a subprocess) against dequantize-then-matmul, so the index arithmetic of
its loops is checked on every CI run: the "runs" and "runs8" loops, split-K, runs of 32 to 128
inputs, strips past N, K past the last step and in whole steps, one and three rows, a bias and the
gated form. tests/gpu runs them compiled."""
from __future__ import annotations

import torch

from tests.triton_interpreter import run_interpreted


def check_kernels() -> None:
    from shardserve.kernels.quant import reference, triton_fp8_gemv
    gen = torch.Generator().manual_seed(0)
    for n, k in ((40, 1100), (24, 2048)):   # strips past n; K past the last step, and K in whole steps
        for gated in (False, True):
            w = (torch.randn(2 * n if gated else n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            scale = torch.rand(w.shape[0], generator=gen) * 0.01 + 0.001
            bias = None if gated else torch.randn(n, generator=gen).half()
            for rows in (1, 3):
                x = torch.randn(rows, k, generator=gen).half()   # the interpreter has no bf16 arithmetic
                want = reference.matmul(x.float(), reference.fp8_weight(w, scale, torch.float32),
                                        bias.float() if bias is not None else None, gated)
                for tiles in (("runs8", 16, 64, 1, 2, 1), ("runs8", 16, 128, 1, 2, 2), ("runs8", 32, 32, 2, 2, 3),
                              ("runs", 16, 64, 1, 2, 2)):
                    got = triton_fp8_gemv.gemv(x, w, scale, bias, gated, tiles=tiles).float()
                    err = ((got - want).norm() / want.norm()).item()
                    assert err < 2e-3, (n, k, gated, rows, tiles, err)


def test_kernels_under_the_interpreter():
    run_interpreted("tests.quantization.test_fp8_gemv_kernels", "check_kernels", timeout=900)
