"""GPTQ and AWQ 4-bit checkpoints written in the layouts their tools use (see shardserve/quantization/
int4.py for the formats), by round-to-nearest asymmetric quantization of an HF checkpoint: no
calibration, so the INT4 error is larger than GPTQ's or AWQ's would be, which makes the accuracy
checks conservative. The packing here is written independently of the reader's unpacking."""
from __future__ import annotations

import torch

from tests.quantization.checkpoints import is_quantized_linear, write_quantized_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # AutoAWQ's order of 8 outputs within a word


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_int4(values: torch.Tensor, dim: int, awq_order: bool = False, bits: int = 4) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 words of 8 consecutive values along `dim` (value j at bits 4j),
    or with awq_order (dim 1) nibble i holding column 8c + AWQ_ORDER[i]. bits=8: values 0..255, four
    to a word (value j at bits 8j), as AutoGPTQ packs 8-bit checkpoints."""
    v = values.long() if dim == 1 else values.long().t()
    v = v.reshape(v.shape[0], -1, 32 // bits)
    if awq_order:
        v = v[:, :, list(AWQ_ORDER)]   # nibble i <- column AWQ_ORDER[i]
    words = _to_int32((v << torch.arange(0, 32, bits)).sum(dim=2))
    return words if dim == 1 else words.t().contiguous()


def quantize_rtn(weight: torch.Tensor, group_index: torch.Tensor, sym: bool = False,
                 bits: int = 4) -> tuple[torch.Tensor, ...]:
    """[N, K] weight, group of each input [K] -> q [K, N], zeros [G, N] (ints 0..15), fp16 scales [G, N]
    and the dequantized weight [N, K] in fp32 (what the INT4 model computes with). Per group and
    output: scale = (max - min) / 15, zero = round(-min / scale) (AutoAWQ's RTN grid); bits=8: 255
    levels, values and zeros 0..255."""
    top = (1 << bits) - 1
    w = weight.float().t()   # [K, N]
    index = group_index.view(-1, 1).expand_as(w)
    groups = int(group_index.max()) + 1
    lo = torch.full((groups, w.shape[1]), float("inf")).scatter_reduce(0, index, w, "amin")
    hi = torch.full((groups, w.shape[1]), float("-inf")).scatter_reduce(0, index, w, "amax")
    if sym:   # GPTQ's symmetric grid: zero 8 (8-bit: 128), scale 2 * absmax / 15 (255)
        scales = (torch.maximum(-lo, hi) * 2 / top).clamp_min(1e-5).half()
        zeros = torch.full_like(lo, (top + 1) // 2, dtype=torch.long)
    else:
        scales = ((hi - lo) / top).clamp_min(1e-5).half()
        zeros = (-lo / scales.float()).round().clamp(0, top).long()
    s, z = scales.float()[group_index], zeros[group_index]
    q = ((w / s).round() + z).clamp(0, top).long()
    return q, zeros, scales, ((q - z).float() * s).t().contiguous()


def group_index(k: int, group_size: int, desc_act: bool = False, seed: int | None = None) -> torch.Tensor:
    """Each input's group; desc_act: GPTQ's activation order, groups of a (seeded, per-K unless `seed`
    is given) permutation of the inputs, the same for every layer reading the same inputs."""
    if not desc_act:
        return torch.arange(k) // group_size
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(k if seed is None else seed))
    index = torch.empty(k, dtype=torch.long)
    index[perm] = torch.arange(k) // group_size
    return index


def gptq_config(group_size: int, desc_act: bool = False, sym: bool = False, fmt: str = "gptq", bits: int = 4) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": fmt, "true_sequential": True, "damp_percent": 0.01, "static_groups": False,
            "lm_head": False}


def awq_config(group_size: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def quantized_tensors(fmt: str, base: str, weight: torch.Tensor, group_size: int,
                      desc_act: bool = False, sym: bool = False,
                      seed: int | None = None, bits: int = 4) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear's checkpoint tensors (`base`.qweight ...) and its dequantized weight (bits 8: GPTQ)."""
    index = group_index(weight.shape[1], group_size, desc_act, seed)
    q, zeros, scales, dequantized = quantize_rtn(weight, index, sym, bits)
    if fmt.startswith("gptq"):   # v1 stores zero - 1, modulo 16 (256); v2 the zero itself
        stored = zeros if fmt == "gptq_v2" else (zeros - 1) & ((1 << bits) - 1)
        out = {"qweight": pack_int4(q, 0, bits=bits), "qzeros": pack_int4(stored, 1, bits=bits),
               "g_idx": index.to(torch.int32)}
    else:
        out = {"qweight": pack_int4(q, 1, awq_order=True), "qzeros": pack_int4(zeros, 1, awq_order=True)}
    out["scales"] = scales
    return {f"{base}.{k}": v for k, v in out.items()}, dequantized


def write_int4_checkpoint(src: str, dst: str, fmt: str, group_size: int, desc_act: bool = False,
                          sym: bool = False, lm_head: bool = False, bits: int = 4,
                          **config_overrides) -> dict[str, torch.Tensor]:
    """`src` as a GPTQ (`fmt="gptq"`: v1 zeros, `"gptq_v2"`) or AWQ (`"awq"`, GEMM) checkpoint: every decoder
    linear quantized (lm_head: the LM head too, GPTQ's `lm_head: true`), the rest as it was, config.json's
    quantization_config as the tools write it (updated with `config_overrides`). Returns the
    dequantized weights by HF name."""
    config = {**(gptq_config(group_size, desc_act, sym, fmt, bits) if fmt != "awq" else awq_config(group_size)),
              **config_overrides}
    if lm_head:
        config["lm_head"] = True
    return write_quantized_checkpoint(
        src, dst, lambda base, t: quantized_tensors(fmt, base, t, group_size, desc_act, sym, bits=bits), config,
        select=lambda name: is_quantized_linear(name) or (lm_head and name == "lm_head.weight"))
