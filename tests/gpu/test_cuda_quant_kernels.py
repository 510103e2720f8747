"""The quantized-weight Triton kernels (kernels/quant/) against dequantize-then-matmul in fp32
(kernels/quant/reference.py) on a GPU: the FP8 GEMV's two inner loops, the W4A16 FMA GEMV, the
tensor-core W4A16 kernel and the dequantize kernel; the decode GEMVs of session 16 (the FP8 "runs"
loop, the tensor-core W4A16 GEMV, both with split-K, whose counters must be back at zero after each
call: each setting runs twice) and session 17's loops (FP8 "runs8", the W4A16 "mmak" loop, the
scales and zeros spread by a tensor-core product, fp32 scales on the per-run fold), over
Llama-3-8B shapes and sizes that are no multiple of any block, plain, with a bias and in the
gated gate_up form."""
from __future__ import annotations

import pytest
import torch

from shardserve.kernels.quant import int4_layout, reference
from tests.quantization.test_fp4_kernels import split_k_counters_zero

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("GPU-only: needs CUDA and Triton", allow_module_level=True)


def _close(got: torch.Tensor, want: torch.Tensor, rows: int, n: int) -> None:
    """Within bf16 rounding of the output: the kernels sum in fp32 in another order than the
    reference, and round once."""
    assert got.shape == (rows, n)
    assert not got.isnan().any()
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 6e-3, err
    assert torch.allclose(got.float(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item()), \
        (got.float() - want).abs().max()


def _fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from shardserve.quantization.fp8 import quantize_rows
    return quantize_rows(torch.randn(n, k, device="cuda") * 0.05)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="E4M3 tensors need compute capability 8.9+")
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("n,k,gated,bias", [(6144, 4096, False, False), (4096, 14336, False, False),
                                            (14336, 4096, True, False), (1000, 904, False, True),
                                            (328, 200, True, False)])
def test_fp8_gemv_matches_dequantized_reference(rows, n, k, gated, bias):
    from shardserve.kernels.quant import triton_fp8_gemv
    torch.manual_seed(rows * 7 + k)
    w, scale = _fp8_weight(2 * n if gated else n, k)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    assert triton_fp8_gemv.handles(x, w)
    want = reference.matmul(x.float(), reference.fp8_weight(w, scale, torch.float32),
                            b.float() if b is not None else None, gated)
    for tiles in (("fma", 16, 512, 4, 1), ("fma", 8, 128, 2, 1), ("dot", 32, 256, 4, 4), ("dot16", 64, 512, 4, 3)):
        _close(triton_fp8_gemv.gemv(x, w, scale, b, gated, tiles=tiles), want, rows, n)   # every inner loop
    _close(triton_fp8_gemv.gemv(x, w, scale, b, gated), want, rows, n)
    assert not triton_fp8_gemv.handles(torch.randn(17, k, device="cuda", dtype=torch.bfloat16), w)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 300])
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (14336, 4096, True), (1000, 904, False)])
def test_int8_weights_match_dequantized_reference(rows, n, k, gated):
    """INT8 weights kept on the GPU (quantization/int8.py): up to 16 rows through the FP8 GEMV's loops
    (W8A16, INT8 widened by the byte trick) against dequantize-then-matmul; more rows rounded to INT8
    per token on the INT8 tensor cores (W8A8, kernels/quant/triton_int8.py) bit for bit against the
    same roundings in torch with exact sums, and near the dequantized reference."""
    from shardserve.kernels.quant import triton_fp8_gemv, triton_int8
    torch.manual_seed(rows + k)
    w = torch.randint(-127, 128, (2 * n if gated else n, k), dtype=torch.int8, device="cuda")
    w[0, :8] = torch.tensor([-128, -127, -1, 0, 1, 126, 127, -64], dtype=torch.int8)   # every byte class
    scale = torch.rand(w.shape[0], device="cuda") * 1e-3 + 1e-4
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    wf = w.float() * scale[:, None]
    if rows <= triton_fp8_gemv.MAX_ROWS:
        assert triton_fp8_gemv.handles(x, w, gated)
        _close(triton_fp8_gemv.gemv(x, w, scale, gated=gated), reference.matmul(x.float(), wf, None, gated), rows, n)
        return
    if gated:
        return   # (more rows: the plain matmul, then SiLU-and-mul)
    xs = (x.float().abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
    xq = (x.float() / xs).round().clamp(-127, 127)
    exact = (xq.double() @ w.double().t()).float() * xs * scale
    assert triton_int8.handles(x, w)
    got = triton_int8.matmul(x, w, scale, None)
    assert torch.equal(got, exact.to(torch.bfloat16))
    _close(got, (xq * xs) @ wf.t(), rows, n)


def _int4_weight(n: int, k: int, group: int, run: int) -> tuple[torch.Tensor, ...]:
    groups = -(-k // group)
    q = torch.randint(0, 16, (k, n), dtype=torch.int32, device="cuda")
    scales = (torch.rand(groups, n, device="cuda") * 0.004 + 0.001).half()
    zeros = torch.randint(0, 16, (groups, n), dtype=torch.uint8, device="cuda")
    return int4_layout.pack(q, run), scales, zeros


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 100])
@pytest.mark.parametrize("n,k,group,gated,bias", [(6144, 4096, 128, False, False), (4096, 14336, 128, False, False),
                                                  (14336, 4096, 64, True, False), (1000, 904, 8 * 113, False, True),
                                                  (328, 200, 32, True, False), (520, 320, 64, False, True)])
def test_w4a16_kernels_match_dequantized_reference(rows, n, k, group, gated, bias):
    """Groups of 128, 64 and 32 inputs, one group over all of K (904), K not a multiple of any
    block of runs, N not a multiple of any strip."""
    from shardserve.kernels.quant import triton_w4a16
    torch.manual_seed(rows * 7 + k)
    g, run = int4_layout.kernel_group(group, k)
    words, scales, zeros = _int4_weight(2 * n if gated else n, k, group, run)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    full = reference.int4_weight(words, scales, zeros, k, group, run, torch.float32)
    want = reference.matmul(x.float(), full, b.float() if b is not None else None, gated)
    args = (words, scales, zeros, k, g, run)
    if rows <= triton_w4a16.FMA_ROWS:
        for tiles in (None, (8, 2), (32, 8)):
            _close(triton_w4a16.gemv_fma(x, *args, b, gated, tiles=tiles), want, rows, n)
    if gated:   # more rows: the stacked matmul, then SiLU-and-mul (as MergedColumnParallelLinear does)
        y = triton_w4a16.matmul_dot(x, *args)
        _close(y, reference.matmul(x.float(), full), rows, 2 * n)
        return
    for tiles in (None, (16, 64, 4, 3), (16, 128, 8, 2)):   # 16 rows a tile (the x runs fill shared memory)
        _close(triton_w4a16.matmul_dot(x, *args, b, tiles=tiles), want, rows, n)
    w = triton_w4a16.dequantize(*args, torch.float32)
    assert torch.allclose(w, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [17, 32, 40, 64])
@pytest.mark.parametrize("n,k,group,bias", [(6144, 4096, 128, False), (4096, 14336, 128, True),
                                            (4096, 2048, 32, False), (28672, 4096, 32, False),
                                            (1000, 904, 8 * 113, True)])
def test_w4a16_dot_17_to_64_rows_split_k(rows, n, k, group, bias):
    """The W4A16 matmul's tiles past 16 rows (one row tile, K in parts: split-K; 28672 outputs: no
    split, the workspace cap; K of one block: none) and 16-row tiles over several row tiles, against
    the dequantized reference; split-K's counters back at zero after each call."""
    from shardserve.kernels.quant import triton_w4a16
    torch.manual_seed(rows + k)
    g, run = int4_layout.kernel_group(group, k)
    words, scales, zeros = _int4_weight(n, k, group, run)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = reference.matmul(x.float(), reference.int4_weight(words, scales, zeros, k, group, run, torch.float32),
                            b.float() if b is not None else None)
    for tiles in (None, (64, 32, 4, 1, 2), (16, 64, 4, 2, 4)):
        _close(triton_w4a16.matmul_dot(x, words, scales, zeros, k, g, run, b, tiles=tiles), want, rows, n)
        assert split_k_counters_zero(x.device)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="E4M3 tensors need compute capability 8.9+")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k,gated,bias", [(6144, 4096, False, False), (4096, 14336, False, False),
                                            (14336, 4096, True, False), (1000, 904, False, True),
                                            (328, 200, True, False)])
def test_fp8_runs_gemv_matches_dequantized_reference(rows, n, k, gated, bias):
    from shardserve.kernels.quant import triton_fp8_gemv
    torch.manual_seed(rows * 7 + k)
    w, scale = _fp8_weight(2 * n if gated else n, k)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = reference.matmul(x.float(), reference.fp8_weight(w, scale, torch.float32),
                            b.float() if b is not None else None, gated)
    for tiles in (None, ("runs", 16, 128, 1, 3, 3), ("runs", 64, 64, 4, 3, 2), ("runs8", 32, 64, 2, 3, 1),
                  ("runs8", 16, 64, 1, 4, 2), ("runs8", 16, 128, 1, 3, 2)):
        _close(triton_fp8_gemv.gemv(x, w, scale, b, gated, tiles=tiles), want, rows, n)
        assert split_k_counters_zero(x.device)   # (else the next call's strips never finish)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k,group,gated,bias", [(6144, 4096, 128, False, False), (4096, 14336, 128, False, False),
                                                  (14336, 4096, 64, True, False), (1000, 904, 8 * 113, False, True),
                                                  (328, 200, 32, True, False), (520, 320, 64, False, True)])
def test_w4a16_gemv_matches_dequantized_reference(rows, n, k, group, gated, bias):
    from shardserve.kernels.quant import triton_w4a16_gemv
    torch.manual_seed(rows * 7 + k)
    g, run = int4_layout.kernel_group(group, k)
    words, scales, zeros = _int4_weight(2 * n if gated else n, k, group, run)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    full = reference.int4_weight(words, scales, zeros, k, group, run, torch.float32)
    want = reference.matmul(x.float(), full, b.float() if b is not None else None, gated)
    for tiles in (None, ("mma", 16, 64, 3, 1, 3), ("mma", 64, 32, 2, 4, 3), ("fma", 8, 2), ("mmak", 16, 64, 1, 2, 3),
                  ("mmak", 32, 32, 3, 4, 3)):
        _close(triton_w4a16_gemv.gemv(x, words, scales, zeros, k, g, run, b, gated, tiles=tiles), want, rows, n)
        assert split_k_counters_zero(x.device)   # (else the next call's strips never finish)


@pytest.mark.parametrize("rows", [1, 4])
def test_w4a16_gemv_with_fp16_activations(rows):
    """The fp16 magic number (1024 + q) and fp16 tensor-core tiles."""
    from shardserve.kernels.quant import triton_w4a16_gemv
    torch.manual_seed(rows)
    n, k = 1000, 2048
    words, scales, zeros = _int4_weight(n, k, 128, 128)
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
    want = reference.matmul(x.float(), reference.int4_weight(words, scales, zeros, k, 128, 128, torch.float32))
    for tiles in (("mma", 32, 32, 1, 2, 3), ("mma", 16, 64, 2, 1, 3), ("mmak", 16, 64, 1, 2, 3)):
        _close(triton_w4a16_gemv.gemv(x, words, scales, zeros, k, 128, 128, tiles=tiles), want, rows, n)


@pytest.mark.parametrize("rows", [1, 3])
def test_w4a16_gemv_with_fp32_scales(rows):
    """Scales that fp16 does not hold (int4_layout.compact_scales keeps them fp32): the per-run
    fold, and "mmak" falls back to the "mma" loop."""
    from shardserve.kernels.quant import triton_w4a16_gemv
    torch.manual_seed(rows)
    n, k = 1000, 2048
    words, scales, zeros = _int4_weight(n, k, 128, 128)
    scales = scales.float() * (1 + 2 ** -13)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = reference.matmul(x.float(), reference.int4_weight(words, scales, zeros, k, 128, 128, torch.float32))
    for tiles in (("mma", 32, 32, 1, 2, 3), ("mmak", 16, 64, 2, 2, 3)):
        _close(triton_w4a16_gemv.gemv(x, words, scales, zeros, k, 128, 128, tiles=tiles), want, rows, n)


def test_int4_layout_round_trip_on_the_gpu():
    q = torch.randint(0, 16, (1000, 24), dtype=torch.int32, device="cuda")
    for run in (32, 64, 128):
        words = int4_layout.pack(q, run)
        assert words.shape == (24, int4_layout.padded(1000, run) // 8)
        assert torch.equal(int4_layout.unpack(words, 1000, run), q)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="E4M3 tensors need compute capability 8.9+")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 40, 300])
@pytest.mark.parametrize("n,k,gated,bias", [(6144, 4096, False, False), (4096, 14336, False, False),
                                            (14336, 4096, True, False), (1000, 904, False, True),
                                            (328, 200, True, False)])
def test_fp8_block_kernels_match_dequantized_reference(rows, n, k, gated, bias):
    """Block-scaled FP8 (kernels/quant/triton_fp8_block.py, 128 x 128 blocks, partial at the edges):
    the runs GEMV up to 4 rows (split-K twice in a row: the counters reset), output tiles for any
    row count, the dequantize kernel, and for prefill-sized row counts on aligned shapes cuBLAS's
    block-scaled matmul after the activations' per-group quantization."""
    from shardserve.kernels.quant import triton_fp8_block
    from shardserve.quantization.fp8_block import compact_scale_rows
    torch.manual_seed(rows * 7 + k)
    total = 2 * n if gated else n
    w = (torch.randn(total, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = torch.rand(-(-total // 128), -(-k // 128), device="cuda") * 1e-3
    scales, scale_row = compact_scale_rows(grid.repeat_interleave(128, 0)[:total])
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    dense = reference.fp8_block_weight(w, scales, scale_row, 128, torch.float32)
    want = reference.matmul(x.float(), dense, b.float() if b is not None else None, gated)
    assert triton_fp8_block.handles(x, w, 128) == (rows <= triton_fp8_block.DOT_ROWS)
    assert torch.equal(triton_fp8_block.dequantize(w, scales, scale_row, 128, torch.bfloat16),
                       dense.to(torch.bfloat16))
    tiles = [None, ("dot", 16, 64, 128, 4, 3), ("dot", 64, 128, 64, 4, 3)]
    if rows <= triton_fp8_block.RUNS_ROWS:
        tiles += [("runs", 16, 128, 1, 3, 3), ("runs", 64, 64, 4, 3, 2)]
    for t in tiles:
        _close(triton_fp8_block.matmul(x, w, scales, scale_row, 128, b, gated, tiles=t), want, rows, n)
        assert split_k_counters_zero(x.device)   # (else the next call's strips never finish)
    if k % 128 == 0 and total % 128 == 0 and rows > triton_fp8_block.MAX_ROWS:   # prefill: cuBLAS, W8A8
        assert triton_fp8_block.scaled_mm_works(0), "H100 / H200 with CUDA 12.9+ run the block-scaled _scaled_mm"
        got = triton_fp8_block.scaled_mm(x, w, grid, b)
        y = reference.matmul(x.float(), dense, b.float() if b is not None else None)
        assert got.shape == y.shape
        err = ((got.float() - y).norm() / y.norm()).item()
        assert err < 0.05, err   # the activations rounded to E4M3 per 128 inputs


def test_fp8_group_quantization_matches_torch():
    """quantize_token_groups compiled: the E4M3 values and scales torch computes, bit for bit."""
    from shardserve.kernels.quant import triton_fp8_quant
    x = (torch.randn(37, 4096, device="cuda") * torch.logspace(-3, 3, 4096, device="cuda")).to(torch.bfloat16)
    q, scales = triton_fp8_quant.quantize_token_groups(x, 128)
    assert q.shape == (40, 4096) and scales.shape == (40, 32) and scales.stride() == (1, 40)
    groups = x.float().view(37, 32, 128)
    want_s = (groups.abs().amax(dim=2) / 448).clamp_min(1e-12)
    want_q = (groups / want_s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(37, 4096)
    assert torch.equal(scales[:37], want_s) and torch.equal(q[:37].float(), want_q.float())
    assert not q[37:].float().any()


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 64, 200])
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 1056)])
def test_fp4_matmul(n, k, kind, rows):
    """kernels/quant/triton_fp4.py compiled on its layout: the FP4 layer's values (decoded by
    quantization/fp4.py's unpacking) against dequantize-then-matmul, 16-row tiles with and without
    split-K and wider ones, the scales applied after the products and to the weights first, bf16
    activations, a bias; and the dequantized weight, bit for bit."""
    from shardserve.kernels.quant import triton_fp4
    from tests.quantization.test_fp4_kernels import fp4_case
    packed, scales, row_scale, weight = fp4_case(kind, n, k, torch.Generator().manual_seed(n + k))
    words, scales, row_scale = triton_fp4.repack(packed.cuda()), scales.cuda(), row_scale.cuda()
    x = torch.randn(rows, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16() if rows == 3 else None
    want = x.float() @ weight.cuda().t() + (bias.float() if bias is not None else 0)
    settings = ([(None, None), ((16, 32, 2, 3, 4), None), ((16, 64, 4, 3, 1), None), ((16, 64, 4, 3, 2), True)]
                if rows <= 16 else [(None, None), ((128, 128, 8, 3, 1), None), (None, False)])
    for tiles, first in settings:
        _close(triton_fp4.matmul(x, words, scales, row_scale, bias, kind, k, tiles, first), want, rows, n)
        assert split_k_counters_zero(x.device)
    if rows == 1:
        got = triton_fp4.dequantize(words, scales, row_scale, kind, k, torch.bfloat16)
        assert torch.equal(got, weight.cuda().bfloat16())


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k,gated,bias", [(6144, 4096, False, False), (4096, 14336, False, False),
                                            (14336, 4096, True, False), (1000, 1056, False, True),
                                            (328, 224, True, False)])
def test_fp4_gemv(rows, kind, n, k, gated, bias):
    """kernels/quant/triton_fp4_gemv.py against dequantize-then-matmul in fp32: 8B shapes and sizes
    that are no multiple of a block, split-K (its counters back at zero: each setting runs twice),
    the gated gate_up form, a bias."""
    from shardserve.kernels.quant import reference, triton_fp4, triton_fp4_gemv
    from tests.quantization.test_fp4_kernels import fp4_case
    packed, scales, row_scale, weight = fp4_case(kind, 2 * n if gated else n, k, torch.Generator().manual_seed(n + k))
    words, scales, row_scale = triton_fp4.repack(packed.cuda()), scales.cuda(), row_scale.cuda()
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = reference.matmul(x.float(), weight.cuda(), b.float() if b is not None else None, gated)
    for tiles in (None, (16, 2, 1, 3), (16, 4, 3, 2), (32, 8, 2, 3)):
        _close(triton_fp4_gemv.gemv(x, words, scales, row_scale, kind, k, b, gated, tiles=tiles), want, rows, n)
        assert split_k_counters_zero(x.device)   # (else the next call's strips never finish)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_fp4_gemv_decodes_every_code_and_scale_exactly(kind, dtype):
    """The compiled GEMV and the 5-16-row matmul, one-hot activation rows reading their weights out:
    every code against every scale byte they take (tests/quantization/test_fp4_kernels.py runs their
    PTX on the CPU), bit for bit against quantization/fp4.py's decoding rounded to the activations'
    dtype."""
    from shardserve.kernels.quant import triton_fp4, triton_fp4_gemv
    from shardserve.quantization.fp4 import GROUP, unpack_e2m1
    k = 256
    byte = torch.arange(k // 2, dtype=torch.int64)
    if kind == "nvfp4":
        scale_bytes = [b for b in range(256) if b & 0x7F != 0x7F]
    else:   # the exponents whose products fp32 and the activations' dtype hold
        scale_bytes = list(range(2, 253) if dtype == torch.bfloat16 else range(111, 136))
    n, group = len(scale_bytes), GROUP[kind]
    packed = ((byte % 16) | (((byte * 7 + 3) % 16) << 4)).to(torch.uint8).repeat(n, 1)
    scales = torch.tensor(scale_bytes, dtype=torch.uint8)[:, None].repeat(1, k // group)
    value = (scales.view(torch.float8_e4m3fn).float() if kind == "nvfp4" else torch.exp2(scales.float() - 127))
    want = (unpack_e2m1(packed) * value.repeat_interleave(group, dim=1)).to(dtype).cuda()
    words, scales = triton_fp4.repack(packed).cuda(), scales.cuda()
    eye = torch.eye(k, dtype=dtype, device="cuda")
    got = torch.cat([triton_fp4_gemv.gemv(eye[i:i + 1], words, scales, torch.ones(n, device="cuda"), kind, k)
                     for i in range(k)])   # row i: input i of every output
    assert torch.equal(got.t(), want), (got.t().float() - want.float()).abs().max()
    ones = torch.ones(n, device="cuda")
    got = torch.cat([triton_fp4.matmul(eye[i:i + 16], words, scales, ones, None, kind, k) for i in range(0, k, 16)])
    assert torch.equal(got.t(), want), (got.t().float() - want.float()).abs().max()   # 16 rows: the matmul
    got = triton_fp4.matmul(eye, words, scales, ones, None, kind, k)   # 256 rows: the weights scaled first
    assert torch.equal(got.t(), want), (got.t().float() - want.float()).abs().max()
