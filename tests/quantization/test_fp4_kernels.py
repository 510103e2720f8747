"""The FP4 kernels on the CPU, against quantization/fp4.py's own unpacking:
- the layout (kernels/quant/triton_fp4.py's repack) round trip;
- the decode GEMV's PTX (kernels/quant/triton_fp4_gemv.py), run by a small interpreter of the few
  instructions it uses: every code in every nibble of both words, bit for bit, in bf16 and fp16
  (tests/gpu runs the compiled kernel against every scale byte too);
- the plain Triton kernels (matmul, dequantize) under Triton's interpreter (TRITON_INTERPRET=1, in a
  subprocess): NVFP4 and MXFP4, strips past N, K past the last block, a bias, and every code against
  every scale byte through one-hot activation rows."""
from __future__ import annotations

import re

import pytest
import torch

from tests.triton_interpreter import run_interpreted

MASK32 = 0xFFFFFFFF


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


def split_k_counters_zero(device: torch.device) -> bool:
    """Every split-K counter of `device` back at zero (a call that left one set would make the next
    call's strip never finish: its output would keep whatever the memory held)."""
    from shardserve.kernels.quant import splitk
    index = device.index if device.type != "cuda" or device.index is not None else torch.cuda.current_device()
    held = splitk._BUFFERS.get(index)
    return held is None or not held[1].count_nonzero().item()


def test_repack_round_trip():
    from shardserve.kernels.quant import triton_fp4
    packed = torch.randint(0, 256, (24, 200), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    words = triton_fp4.repack(packed)
    assert words.dtype == torch.int32 and words.shape == (24, 512 // 8)   # K 400 padded to 4 blocks of 128
    assert torch.equal(triton_fp4.codes_of(words, 400), triton_fp4.codes(packed).int())
    # nibble i of word w of a block: input 16 i + w
    assert ((words[:, 3] >> 8) & 0xF).tolist() == triton_fp4.codes(packed)[:, 16 * 2 + 3].tolist()


def _halves(r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 32-bit registers -> their two 16-bit halves as `dtype` values in fp32 [..., 2]."""
    bits = torch.stack((r & 0xFFFF, (r >> 16) & 0xFFFF), dim=-1)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(dtype).float()


def _pack_halves(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bits = v.to(dtype).view(torch.int16).long() & 0xFFFF
    return bits[..., 0] | (bits[..., 1] << 16)


def run_ptx(asm: str, regs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the GEMV's unpacking PTX on int64 tensors of 32-bit values (operands $n, locals, immediates)."""
    def val(x: str) -> torch.Tensor | int:
        return int(x, 16) if x.startswith("0x") else regs[x]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("}", "") or line.startswith("{"):
            continue
        op, args = line.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            regs[a[0]] = torch.zeros_like(regs["$8"]) + val(a[1])
        elif op == "prmt.b32":   # bytes of (b, a) picked by the selector's four nibbles
            src, sel = val(a[1]) | (val(a[2]) << 32), val(a[3])
            regs[a[0]] = sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "shl.b32":
            regs[a[0]] = (val(a[1]) << int(a[2])) & MASK32
        elif op == "shr.u32":
            regs[a[0]] = val(a[1]) >> int(a[2])
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "lop3.b32":
            assert a[4] == "0xEA"   # (a & b) | c
            regs[a[0]] = (val(a[1]) & val(a[2])) | val(a[3])
        elif op == "fma.rn.bf16x2":   # a * b + (-0): the exact product, one rounding
            assert int(val(a[3]).flatten()[0]) == 0x80008000
            regs[a[0]] = _pack_halves(_halves(val(a[1]), torch.bfloat16) * _halves(val(a[2]), torch.bfloat16),
                                      torch.bfloat16)
        else:
            raise AssertionError(f"the interpreter lacks {op}")
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_ptx_decodes_every_code_exactly(dtype):
    """The asm's weights are e2m1 (fp16: times 2^-14) for every code in every nibble of both words."""
    from shardserve.kernels.quant import triton_fp4
    from shardserve.quantization.fp4 import E2M1
    bf16 = dtype == torch.bfloat16
    asm = triton_fp4._unpack_asm(bf16)
    assert set(re.findall(r"^\s*([a-z0-9.]+)\s", asm, re.M)) <= {
        "mov.b32", "prmt.b32", "shl.b32", "shr.u32", "and.b32", "lop3.b32", "fma.rn.bf16x2"}
    codes = torch.arange(16, dtype=torch.int64)
    value = torch.tensor(E2M1, dtype=torch.float64)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    shift = torch.arange(16, dtype=torch.int64)   # lane s: $8's nibble i holds code (i + s) % 16, $9's (i + s + 7) % 16
    w0 = sum(((shift + i) % 16) << (4 * i) for i in range(8))
    w1 = sum(((shift + i + 7) % 16) << (4 * i) for i in range(8))
    out = run_ptx(asm, {"$8": w0, "$9": w1})
    for i in range(8):
        got = _halves(out[f"${i}"], dtype).double() * (1.0 if bf16 else 2.0 ** 14)
        want = torch.stack((value[(shift + i) % 16], value[(shift + i + 7) % 16]), dim=-1)
        assert torch.equal(got, want), (dtype, i)


def check_kernels() -> None:
    from shardserve.kernels.quant import triton_fp4
    gen = torch.Generator().manual_seed(0)
    for kind in ("nvfp4", "mxfp4"):
        for n, k in ((40, 160), (24, 512)):   # strips past n; K past the last block, and K in whole blocks
            packed, scales, row_scale, weight = fp4_case(kind, n, k, gen)
            words = triton_fp4.repack(packed)
            got = triton_fp4.dequantize(words, scales, row_scale, kind, k, torch.float16).float()
            assert torch.equal(got, weight.half().float()), (kind, n, k)
            for rows, tiles, first in ((1, None, None), (3, (16, 16, 4, 1, 3), None), (5, None, None),
                                       (20, None, None), (40, None, None), (70, (32, 16, 4, 1, 1), None),
                                       (20, None, False),
                                       (3, (16, 16, 4, 1, 3), True), (5, None, True)):
                x = torch.randn(rows, k, generator=gen).half()   # the interpreter has no bf16 arithmetic
                bias = torch.randn(n, generator=gen).half() if rows in (3, 70) else None
                want = x.float() @ weight.t() + (bias.float() if bias is not None else 0)
                got = triton_fp4.matmul(x, words, scales, row_scale, bias, kind, k, tiles, first).float()
                err = ((got - want).norm() / want.norm()).item()
                assert err < 2e-3, (kind, n, k, rows, tiles, first, err)
                assert split_k_counters_zero(x.device)


def check_exact_decoding() -> None:
    """Every code against every scale byte the format has (E4M3 with its sign bit and subnormals,
    NaN excepted; E8M0 over the exponents whose products fp16 holds), read out bit for bit through
    one-hot activation rows: the kernels' bit placement against quantization/fp4.py's decoding."""
    from shardserve.kernels.quant import triton_fp4
    from shardserve.quantization.fp4 import E8M0_BIAS, unpack_e2m1
    k = 32   # 16 bytes: byte j holds codes j and 15 - j, so every code is in every row
    nibbles = torch.arange(16, dtype=torch.uint8)
    for kind, scale_bytes in (("nvfp4", [b for b in range(256) if b & 0x7F != 0x7F]),
                              ("mxfp4", list(range(E8M0_BIAS - 20, E8M0_BIAS + 12)))):
        n, group = len(scale_bytes), 16 if kind == "nvfp4" else 32
        packed = (nibbles | ((15 - nibbles) << 4)).repeat(n, 1)
        scales = torch.tensor(scale_bytes, dtype=torch.uint8)[:, None].repeat(1, k // group)
        value = (scales.view(torch.float8_e4m3fn).float() if kind == "nvfp4"
                 else torch.exp2(scales.float() - E8M0_BIAS))
        want = (unpack_e2m1(packed) * value.repeat_interleave(group, dim=1)).half()
        words = triton_fp4.repack(packed)
        for first in (False, True):   # scales after the products, or on the weights first
            got = triton_fp4.matmul(torch.eye(k).half(), words, scales, torch.ones(n), None, kind, k,
                                    scale_first=first)   # [k, n]: w^T
            assert torch.equal(got.t(), want), (kind, first, (got.t().float() - want.float()).abs().max())
        assert torch.equal(triton_fp4.dequantize(words, scales, torch.ones(n), kind, k, torch.float16), want)


def test_kernels_under_the_interpreter():
    run_interpreted("tests.quantization.test_fp4_kernels", "check_kernels", timeout=900)


def test_every_nibble_and_scale_byte_decodes_exactly():
    run_interpreted("tests.quantization.test_fp4_kernels", "check_exact_decoding", timeout=900)


def test_split_k_workspace_outgrown_stays_alive():
    """A split-K workspace replaced by a larger one is kept (CUDA graphs captured before write to it),
    and the FP4 matmul's default tiles never split an LM head's outputs (which would grow it)."""
    from shardserve.kernels.quant import splitk, triton_fp4
    device = torch.device("cpu")
    splitk._BUFFERS.pop(None, None)
    small, _ = splitk.buffers(device, 16, 4)
    large, _ = splitk.buffers(device, splitk.MIN_FLOATS + 1, 4)
    assert large.numel() > small.numel() and any(t is small for t in splitk._OUTGROWN)
    assert splitk.buffers(device, 16, 4)[0] is large
    for rows in (16, 32, 64):
        block_m, block_n, _, _, split = triton_fp4.tiles_for(rows, 128256)
        assert split == 1
        for n in (4096, 6144, 28672):
            block_m, block_n, _, _, split = triton_fp4.tiles_for(rows, n)
            assert split * block_m * 2 * n <= splitk.MIN_FLOATS and block_m >= rows
