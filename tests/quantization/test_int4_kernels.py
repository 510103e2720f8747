"""The INT4 W4A16 tensor-core matmul (kernels/quant/triton_w4a16.py's `matmul_dot`) on the CPU, under
Triton's interpreter (TRITON_INTERPRET=1, in a subprocess): its row tiles and its split-K parts
against the layout's own dequantized values, so the index arithmetic is checked on every CI run;
tests/gpu/test_cuda_quant_kernels.py runs it compiled."""
from __future__ import annotations

import torch

from tests.quantization.test_fp4_kernels import split_k_counters_zero
from tests.triton_interpreter import run_interpreted


def check_matmul_dot() -> None:
    from shardserve.kernels.quant import int4_layout, reference, triton_w4a16
    gen = torch.Generator().manual_seed(0)
    for group, n, k in ((128, 40, 1100), (32, 24, 1280)):   # K past the last block of runs; 5 whole blocks
        g, run = int4_layout.kernel_group(group, k)
        q = torch.randint(0, 16, (k, n), dtype=torch.int32, generator=gen)
        scales = (torch.rand(-(-k // group), n, generator=gen) * 0.004 + 0.001).half()
        zeros = torch.randint(0, 16, scales.shape, dtype=torch.uint8, generator=gen)
        args = (int4_layout.pack(q, run), scales, zeros, k, g, run)
        full = reference.int4_weight(*args, torch.float32)
        for rows, tiles in ((5, None), (20, None), (40, None), (20, (32, 16, 4, 1, 3)), (40, (16, 16, 4, 1, 2)),
                            (3, (16, 16, 4, 1, 4))):   # 5 blocks in 4 parts of 2: the last starts past them
            x = torch.randn(rows, k, generator=gen).half()   # the interpreter has no bf16 arithmetic
            bias = torch.randn(n, generator=gen).half() if rows == 20 else None
            want = x.float() @ full.t() + (bias.float() if bias is not None else 0)
            got = triton_w4a16.matmul_dot(x, *args, bias, tiles=tiles).float()
            err = ((got - want).norm() / want.norm()).item()
            assert err < 2e-3, (group, rows, tiles, err)
            assert split_k_counters_zero(x.device)


def test_matmul_dot_under_the_interpreter():
    run_interpreted("tests.quantization.test_int4_kernels", "check_matmul_dot", timeout=900)
