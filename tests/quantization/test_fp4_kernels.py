"""The FP4 W4A16 matmul (kernels/quant/triton_fp4.py) under Triton's interpreter on the CPU
(TRITON_INTERPRET=1, in a subprocess) against dequantize-then-matmul on quantization/fp4.py's own
unpacking, so its bit decoding and index arithmetic are checked on every CI run: NVFP4 and MXFP4,
every E2M1 nibble and a spread of scale bytes (E4M3 subnormals included), strips past N, K past
the last step, decode and prefill tiles, a bias. tests/gpu runs it compiled."""
from __future__ import annotations

import torch

from tests.triton_interpreter import run_interpreted


def fp4_case(kind: str, n: int, k: int, gen: torch.Generator):
    """(packed, scale bytes, row scales, the weight they hold in fp32) for a random FP4 layer."""
    from shardserve.quantization.fp4 import E8M0_BIAS, GROUP, unpack_e2m1
    group = GROUP[kind]
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    if kind == "nvfp4":   # E4M3 bytes of positive scales, subnormals among them
        scales = (torch.rand(n, k // group, generator=gen) * 2.0 ** torch.randint(-9, 4, (n, k // group),
                                                                                   generator=gen)).to(torch.float8_e4m3fn)
        value = scales.float()
        scales = scales.view(torch.uint8)
        row_scale = torch.rand(n, generator=gen) + 0.5
    else:
        scales = torch.randint(E8M0_BIAS - 8, E8M0_BIAS + 3, (n, k // group), dtype=torch.uint8, generator=gen)
        value = torch.exp2(scales.float() - E8M0_BIAS)
        row_scale = torch.ones(n)
    weight = unpack_e2m1(packed) * value.repeat_interleave(group, dim=1) * row_scale[:, None]
    return packed, scales, row_scale, weight


def check_kernels() -> None:
    from shardserve.kernels.quant import triton_fp4
    gen = torch.Generator().manual_seed(0)
    for kind in ("nvfp4", "mxfp4"):
        for n, k in ((40, 160), (24, 512)):   # strips past n; K past the last step, and K in whole steps
            packed, scales, row_scale, weight = fp4_case(kind, n, k, gen)
            for rows, tiles in ((1, None), (3, (16, 16, 64, 4)), (20, None), (70, (32, 16, 32, 4))):
                x = torch.randn(rows, k, generator=gen).half()   # the interpreter has no bf16 arithmetic
                bias = torch.randn(n, generator=gen).half() if rows == 3 else None
                want = x.float() @ weight.t() + (bias.float() if bias is not None else 0)
                got = triton_fp4.matmul(x, packed, scales, row_scale, bias, kind, tiles).float()
                err = ((got - want).norm() / want.norm()).item()
                assert err < 2e-3, (kind, n, k, rows, tiles, err)


def check_exact_decoding() -> None:
    """Every nibble against every scale byte the format has (E4M3 with its sign bit and subnormals,
    NaN excepted; E8M0 over the exponents whose products fp16 holds), read out bit for bit through
    one-hot activation rows: the kernel's bit placement against quantization/fp4.py's decoding."""
    from shardserve.kernels.quant import triton_fp4
    from shardserve.quantization.fp4 import E8M0_BIAS, unpack_e2m1
    k = 32   # 16 bytes: byte j holds nibbles j and 15 - j, so every nibble is in every row
    nibbles = torch.arange(16, dtype=torch.uint8)
    for kind, scale_bytes in (("nvfp4", [b for b in range(256) if b & 0x7F != 0x7F]),
                              ("mxfp4", list(range(E8M0_BIAS - 20, E8M0_BIAS + 12)))):
        n, group = len(scale_bytes), 16 if kind == "nvfp4" else 32
        packed = (nibbles | ((15 - nibbles) << 4)).repeat(n, 1)
        scales = torch.tensor(scale_bytes, dtype=torch.uint8)[:, None].repeat(1, k // group)
        value = (scales.view(torch.float8_e4m3fn).float() if kind == "nvfp4"
                 else torch.exp2(scales.float() - E8M0_BIAS))
        want = (unpack_e2m1(packed) * value.repeat_interleave(group, dim=1)).half()
        got = triton_fp4.matmul(torch.eye(k).half(), packed, scales, torch.ones(n), None, kind)   # [k, n]: w^T
        assert torch.equal(got.t(), want), (kind, (got.t().float() - want.float()).abs().max())


def test_kernels_under_the_interpreter():
    run_interpreted("tests.quantization.test_fp4_kernels", "check_kernels", timeout=900)


def test_every_nibble_and_scale_byte_decodes_exactly():
    run_interpreted("tests.quantization.test_fp4_kernels", "check_exact_decoding", timeout=900)
