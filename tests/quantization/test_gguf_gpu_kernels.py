"""The GPU side of GGUF kept in blocks, on the CPU: the planes (kernels/quant/gguf_layout.py) expand
to exactly gguf's own dequantization of the file's blocks, and the Triton kernels
(kernels/quant/triton_gguf.py) run under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess:
the switch is read when the kernels are defined) against dequantize-then-matmul, so their index
arithmetic is checked on every CI run; tests/gpu/test_cuda_gguf.py runs them compiled."""
from __future__ import annotations

import pytest
import torch

from shardserve.kernels.quant import gguf_layout
from tests.quantization.test_gguf_quant import _weights
from tests.triton_interpreter import TRITON_REASON, run_interpreted


@pytest.mark.parametrize("type_name", gguf_layout.TYPES)
def test_planes_expand_to_the_files_values(type_name):
    n, k = 5, 512
    raw, ref = _weights(type_name, n, k)
    planes = gguf_layout.to_planes(raw, type_name, k)
    assert torch.equal(gguf_layout.dequantize(planes), ref)
    file_bytes = raw.numel()
    unpacked = n * k // 64 if type_name in ("Q4_K", "Q5_K") else 0   # 12 bytes of 6-bit fields -> 16
    assert planes.nbytes() == file_bytes + unpacked


@pytest.mark.parametrize("type_name", gguf_layout.INT4_TYPES)
def test_4_bit_types_in_the_w4a16_layout_are_the_same_weight(type_name):
    """Q4_0 (zero point 8) and Q4_1 (fp16 mins) exactly; Q4_K's d * scale and dmin * min rounded to
    fp16 once: within 2^-11 of each product."""
    from shardserve.kernels.quant import reference
    k = 544 if type_name != "Q4_K" else 768   # 544: K padded to the layout's blocks of 8 x 32
    raw, ref = _weights(type_name, 24, k)
    w = gguf_layout.gpu_weight(raw, type_name, k)
    assert isinstance(w, gguf_layout.Int4Weight) and w.planes["scales"].dtype == torch.float16
    assert w.planes["zeros"].dtype == (torch.uint8 if type_name == "Q4_0" else torch.float16)
    got = reference.gguf_weight([(slice(0, 24), w)], 24, torch.float32)
    if type_name != "Q4_K":
        assert torch.equal(got, ref)
        return
    planes = gguf_layout.to_planes(raw, type_name, k).planes
    e = torch.arange(k)
    scale = planes["d"].float()[:, e // 256] * planes["s"].float()[:, e // 32]
    minimum = planes["dm"].float()[:, e // 256] * planes["m"].float()[:, e // 32]
    assert ((got - ref).abs() <= 2.0 ** -11 * (15 * scale + minimum) + 1e-12).all()
    assert not torch.equal(got, ref)   # some products do round


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("type_name", gguf_layout.TYPES)
def test_rows_of_a_kept_table(type_name, exact):
    """An embedding lookup on a table kept as a GPU holds it (W4A16 layout or planes): the rows of
    the whole table's values, in the order asked, repeats included, contiguous (NCCL all-reduces
    a TP rank's rows as they are)."""
    from shardserve.kernels.quant import reference
    raw, _ = _weights(type_name, 40, 512)
    w = gguf_layout.gpu_weight(raw, type_name, 512, exact)
    ids = torch.tensor([3, 0, 39, 3, 17])
    want = reference.gguf_weight([(slice(0, 40), w)], 40, torch.float32)[ids]
    got = gguf_layout.rows(w, ids)
    assert torch.equal(got, want) and got.is_contiguous()


@pytest.mark.parametrize("type_name", gguf_layout.TYPES)
def test_a_weight_repacked_in_chunks_is_the_same(type_name, monkeypatch):
    """gpu_weight repacks CHUNK_ROWS rows at a time (bounded temporaries for an embedding table)."""
    raw, _ = _weights(type_name, 40, 512)
    whole = gguf_layout.gpu_weight(raw, type_name, 512)
    monkeypatch.setattr(gguf_layout, "CHUNK_ROWS", 16)
    chunked = gguf_layout.gpu_weight(raw, type_name, 512)
    assert type(chunked) is type(whole) and chunked.n == 40 and chunked.planes.keys() == whole.planes.keys()
    assert all(torch.equal(chunked.planes[n], whole.planes[n]) and chunked.planes[n].is_contiguous()
               for n in whole.planes)


def check_kernels() -> None:
    """Run under TRITON_INTERPRET=1: every kernel, type and row count against the planes' values."""
    from shardserve.kernels.quant import gguf_matmul, reference, triton_gguf
    torch.manual_seed(0)
    for type_name in gguf_layout.TYPES:
        n, k = 24, 512 if type_name.endswith("_K") else 480   # 480: a last step past K (masked)
        raw, ref = _weights(type_name, n, k)
        w = gguf_layout.to_planes(raw, type_name, k)
        bias = torch.randn(n)
        for rows, loop in ((1, 0), (3, 1), (1, 2), (3, 2)):   # fp32 activations: products in full fp32
            x = torch.randn(rows, k)
            got = triton_gguf.gemv(x, w, bias, tiles=(16, 4, 256, 3, loop))
            torch.testing.assert_close(got.double(), x.double() @ ref.double().T + bias.double(), rtol=1e-5,
                                       atol=1e-4 * ref.abs().max().item())
        x = torch.randn(7, k, dtype=torch.float16)   # the interpreter has no bf16 arithmetic
        expected = x.double() @ ref.double().T
        for loop in (1, 2):
            got = triton_gguf.gemv(x, w, tiles=(16, 4, 256, 3, loop))
            torch.testing.assert_close(got.double(), expected, rtol=2e-3, atol=2e-3 * expected.abs().max().item())
        assert torch.equal(triton_gguf.dequantize(w, torch.float32), ref), type_name
    # A fused layer whose parts differ in type: one run of rows per type, written into one output
    # (Q4_K and Q4_0 in the W4A16 layout, mins and zero points: fp32 activations take its torch
    # reference, 20 rows its dequantize kernel).
    parts = [("Q4_K", 16), ("Q6_K", 8), ("Q4_0", 8)]
    weights = [_weights(t, n, 256, seed=i) for i, (t, n) in enumerate(parts)]
    runs, start = [], 0
    for (type_name, n), (raw, _) in zip(parts, weights):
        runs.append((slice(start, start + n), gguf_layout.gpu_weight(raw, type_name, 256)))
        start += n
    assert [isinstance(w, gguf_layout.Int4Weight) for _, w in runs] == [True, False, True]
    ref = reference.gguf_weight(runs, 32, torch.float32)   # the layout's own values (Q4_K's rounded scales)
    for rows in (2, 20):   # the GEMV; the weight dequantized for the matmul
        x = torch.randn(rows, 256)
        torch.testing.assert_close(gguf_matmul.matmul(x, runs, 32).double(), x.double() @ ref.double().T,
                                   rtol=1e-5, atol=1e-3)


def test_triton_kernels_under_the_interpreter():
    run_interpreted("tests.quantization.test_gguf_gpu_kernels", "check_kernels")


def test_which_types_a_gpu_keeps(monkeypatch):
    """Q4_0, Q4_1 and Q4_K (on the W4A16 kernels, faster than bf16) by default; every type with the
    switch at 0 (the memory, at about half bf16's decode speed for the others); none at 1."""
    pytest.importorskip("triton", reason=TRITON_REASON)
    from shardserve.quantization.gguf import DEQUANTIZE_SWITCH, gpu_keeps
    monkeypatch.delenv(DEQUANTIZE_SWITCH, raising=False)
    assert [t for t in gguf_layout.TYPES if gpu_keeps(t)] == ["Q4_0", "Q4_1", "Q4_K"]
    monkeypatch.setenv(DEQUANTIZE_SWITCH, "0")
    assert all(gpu_keeps(t) for t in gguf_layout.TYPES) and not gpu_keeps("Q5_0")
    monkeypatch.setenv(DEQUANTIZE_SWITCH, "1")
    assert not any(gpu_keeps(t) for t in gguf_layout.TYPES)
