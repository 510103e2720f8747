"""Dequantization of every block format we claim (F32 ... Q6_K), against the original values."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve.models import gguf_loader

QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """A plain (not error-optimised) Q4_K encoder following ggml's block_q4_K layout:
    d (f16), dmin (f16), 12 bytes of packed 6-bit scales/mins for 8 sub-blocks of 32, 128 bytes
    of 4-bit quants; x_i = d * sc_j * q_i - dmin * m_j."""
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(blocks.min(-1), 0.0)
    scale_f = (blocks.max(-1) - lo) / 15.0
    min_f = -lo
    d = (scale_f.max(-1) / 63.0).astype(np.float16)
    dmin = (min_f.max(-1) / 63.0).astype(np.float16)
    d_f, dmin_f = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(scale_f / np.where(d_f > 0, d_f, 1)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(min_f / np.where(dmin_f > 0, dmin_f, 1)), 0, 63).astype(np.uint8)
    eff_scale = (d_f * sc)[..., None]
    eff_min = (dmin_f * m)[..., None]
    q = np.clip(np.round((blocks + eff_min) / np.where(eff_scale > 0, eff_scale, 1)), 0, 15).astype(np.uint8)
    scales = np.zeros((len(blocks), 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(len(blocks), 128)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    return out.reshape(x.shape[0], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """A plain Q6_K encoder following ggml's block_q6_K layout: ql (128 bytes, low 4 bits),
    qh (64 bytes, high 2 bits), 16 int8 scales for sub-blocks of 16, d (f16);
    x_i = d * sc_j * (q_i - 32)."""
    blocks = x.reshape(-1, 16, 16).astype(np.float32)
    scale_f = np.abs(blocks).max(-1) / 31.0
    d = (scale_f.max(-1) / 127.0).astype(np.float16)
    d_f = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale_f / np.where(d_f > 0, d_f, 1)), 1, 127).astype(np.int8)
    eff = (d_f * sc)[..., None]
    q = (np.clip(np.round(blocks / np.where(eff > 0, eff, 1)), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    ql = np.zeros((len(q), 128), dtype=np.uint8)
    qh = np.zeros((len(q), 64), dtype=np.uint8)
    for half in range(2):
        v = q[:, 128 * half:128 * (half + 1)]
        a, b, c, e = v[:, 0:32], v[:, 32:64], v[:, 64:96], v[:, 96:128]
        ql[:, 64 * half:64 * half + 32] = (a & 0xF) | ((c & 0xF) << 4)
        ql[:, 64 * half + 32:64 * half + 64] = (b & 0xF) | ((e & 0xF) << 4)
        qh[:, 32 * half:32 * half + 32] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)
    return out.reshape(x.shape[0], -1)


# Relative RMS error bound (vs the tensor's std) for each storage type.
QUANT_RMS = {"F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q5_0": 0.06, "Q5_1": 0.06,
             "Q4_0": 0.12, "Q4_1": 0.12, "Q4_K": 0.12, "Q6_K": 0.03}
CUSTOM_ENCODERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory):
    """One GGUF file holding a random 2-D tensor (3 rows x 512, non-square) per type."""
    import gguf
    rng = np.random.default_rng(0)
    originals = {}
    path = str(tmp_path_factory.mktemp("quant") / "quant.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for name in QUANT_RMS:
        x = (rng.standard_normal((3, 512)) * rng.uniform(0.01, 2.0, size=(3, 1))).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[name]
        if name == "F32":
            w.add_tensor(name, x)
        elif name == "F16":
            w.add_tensor(name, x.astype(np.float16))
        elif name in CUSTOM_ENCODERS:
            w.add_tensor(name, CUSTOM_ENCODERS[name](x), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        originals[name] = x
    # A 1-D tensor and a random-bytes Q5_K tensor (no encoder: checked against gguf's decoder).
    w.add_tensor("norm", originals["F32"][0].copy())
    raw = rng.integers(0, 256, size=(2, 2 * 176), dtype=np.uint8)
    for blk in range(4):   # finite f16 super-block scales (d, dmin) at the head of each block
        row, col = divmod(blk * 176, 2 * 176)
        raw[row, col:col + 4] = _f16_bytes(np.array([0.01, 0.02]))[:, :].reshape(-1)
    w.add_tensor("Q5_K", raw, raw_dtype=gguf.GGMLQuantizationType.Q5_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    return {t.name: t for t in reader.tensors}, originals, raw


@pytest.mark.parametrize("name", list(QUANT_RMS))
def test_dequantize(quant_file, name):
    import gguf
    tensors, originals, _ = quant_file
    t, x = tensors[name], originals[name]
    assert t.tensor_type.name == name
    ours = gguf_loader.dequantize(t)
    assert isinstance(ours, torch.Tensor) and tuple(ours.shape) == x.shape
    ours = ours.float().numpy()
    if name not in ("F32", "F16", "BF16"):
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(x.shape)
        np.testing.assert_array_equal(ours, ref)
    rel_rms = np.sqrt(np.mean((ours - x) ** 2, axis=1)) / x.std(axis=1)   # per row: scales differ
    assert (rel_rms <= QUANT_RMS[name]).all(), f"{name}: relative RMS error {rel_rms}"
    if name != "F32":
        assert (rel_rms > 0).all()


def test_dequantize_1d_and_q5_k(quant_file):
    import gguf
    tensors, originals, raw = quant_file
    norm = gguf_loader.dequantize(tensors["norm"])
    assert tuple(norm.shape) == (512,)
    np.testing.assert_array_equal(norm.numpy(), originals["F32"][0])
    t = tensors["Q5_K"]
    ours = gguf_loader.dequantize(t)
    assert tuple(ours.shape) == (2, 512)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K).reshape(2, 512)
    np.testing.assert_array_equal(ours.numpy(), ref)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0


def test_dequantize_unsupported_type(tmp_path):
    import gguf
    path = str(tmp_path / "q2k.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((1, 84), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = gguf.GGUFReader(path).tensors[0]
    with pytest.raises(ValueError) as e:
        gguf_loader.dequantize(t)
    assert "Q2_K" in str(e.value) and "blk.0.attn_q.weight" in str(e.value) and "Q4_K" in str(e.value)
