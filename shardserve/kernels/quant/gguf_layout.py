"""GGUF blocks regrouped for the GPU kernels (kernels/quant/triton_gguf.py): the file's bytes, the
same bits per weight, but each field of the blocks in a plane of its own, row-major [N, ...], so a
kernel loads a strip of rows' quants, scales or high bits with plain strided loads instead of
picking fields out of 18- to 210-byte records. The quants keep the file's order inside a block (the
kernels pair each byte's two nibbles with the activations they belong to); the 6-bit scales and mins
of Q4_K / Q5_K are unpacked to one byte each (4.5 -> 4.625 and 5.5 -> 5.625 bits per weight).

Planes per type (K inputs per row; "q" the quants, "h" the high bits, "s" the per-block scale, "m"
the per-block min, "d" / "dm" the per-super-block scale and min of the K-quants):

| type | q | h | s | m | d, dm |
| --- | --- | --- | --- | --- | --- |
| Q4_0 | uint8 [N, K/2] | | fp16 [N, K/32] | | |
| Q4_1 | uint8 [N, K/2] | | fp16 [N, K/32] | fp16 [N, K/32] | |
| Q8_0 | int8 [N, K] | | fp16 [N, K/32] | | |
| Q4_K | uint8 [N, K/2] | | uint8 [N, K/32] | uint8 [N, K/32] | fp16 [N, K/256] each |
| Q5_K | uint8 [N, K/2] | uint8 [N, K/8] | uint8 [N, K/32] | uint8 [N, K/32] | fp16 [N, K/256] each |
| Q6_K | uint8 [N, K/2] | uint8 [N, K/4] | int8 [N, K/16] | | fp16 [N, K/256] (d) |

`dequantize` expands the planes with torch ops (the kernels-off path, SHARDSERVE_QUANT_KERNELS=0);
the tests hold both it and the kernels to the CPU's dequantization of the file's blocks.

The 4-bit types with one scale per 32 values go to the W4A16 kernels instead of the planes, in their
layout (kernels/quant/int4_layout.py): they are the faster kernels (benchmarks/BENCHMARKS.md). Q4_0
is their format exactly (d (q - 8): an fp16 scale, zero point 8; 4.75 bits per weight); Q4_1 and
Q4_K are q s - m, an fp16 scale and an fp16 min per block of 32 (the kernels' mins form; 5.0 bits
per weight), exact for Q4_1, Q4_K's products d * scale and dmin * min rounded once to fp16.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shardserve.kernels.quant import int4_layout

# Values per block and bytes per block of each type the GPU kernels take.
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
          "Q6_K": (256, 210)}
TYPES = tuple(BLOCKS)


@dataclass
class GgufPlanes:
    """One weight [n, k] of GGUF type `type_name` as planes (the module docstring)."""
    type_name: str
    n: int
    k: int
    planes: dict[str, torch.Tensor]

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes.values())


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block of raw [n, blocks, bytes] -> [n, blocks]."""
    return raw[:, :, at:at + 2].contiguous().view(torch.float16).squeeze(-1)


def _scales_mins_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins per super-block [n, sb, 12] -> the 8 scales
    and 8 mins of its blocks of 32, one byte each [n, sb, 8]."""
    q = packed.to(torch.int32)
    lo_sc, lo_m = q[..., 0:4] & 63, q[..., 4:8] & 63             # blocks 0-3: the low 6 bits
    hi_sc = (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)     # blocks 4-7: 4 bits + the top 2 of bytes 0-3
    hi_m = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)      #   and of bytes 4-7
    return (torch.cat([lo_sc, hi_sc], -1).to(torch.uint8), torch.cat([lo_m, hi_m], -1).to(torch.uint8))


def to_planes(raw: torch.Tensor, type_name: str, k: int) -> GgufPlanes:
    """The file's blocks, uint8 [n, blocks, block bytes] (or [n, row bytes]), of `type_name` -> planes
    on the same device."""
    values, nbytes = BLOCKS[type_name]
    n = raw.shape[0]
    raw = raw.reshape(n, k // values, nbytes)
    flat = lambda t: t.reshape(n, -1).contiguous()   # noqa: E731  [n, blocks, x] -> [n, blocks * x]
    if type_name == "Q4_0":
        planes = {"q": flat(raw[:, :, 2:]), "s": _f16(raw, 0)}
    elif type_name == "Q4_1":
        planes = {"q": flat(raw[:, :, 4:]), "s": _f16(raw, 0), "m": _f16(raw, 2)}
    elif type_name == "Q8_0":
        planes = {"q": flat(raw[:, :, 2:]).view(torch.int8), "s": _f16(raw, 0)}
    elif type_name in ("Q4_K", "Q5_K"):
        sc, mn = _scales_mins_k4(raw[:, :, 4:16])
        planes = {"q": flat(raw[:, :, 16:] if type_name == "Q4_K" else raw[:, :, 48:]), "s": flat(sc),
                  "m": flat(mn), "d": _f16(raw, 0), "dm": _f16(raw, 2)}
        if type_name == "Q5_K":
            planes["h"] = flat(raw[:, :, 16:48])
    else:   # Q6_K: ql[128] qh[64] scales[16] d
        planes = {"q": flat(raw[:, :, :128]), "h": flat(raw[:, :, 128:192]),
                  "s": flat(raw[:, :, 192:208]).view(torch.int8), "d": _f16(raw, 208)}
    return GgufPlanes(type_name, n, k, {name: p.contiguous() for name, p in planes.items()})


def _low_bits(w: GgufPlanes) -> torch.Tensor:
    """The 4 low bits of every value, int32 [n, k], from the "q" plane in the file's order."""
    e = torch.arange(w.k, device=w.planes["q"].device)
    if w.type_name in ("Q4_0", "Q4_1"):   # byte j of a block: value j (low nibble), value j + 16 (high)
        byte, shift = (e // 32) * 16 + e % 16, 4 * ((e % 32) // 16)
    elif w.type_name in ("Q4_K", "Q5_K"):   # byte j of 32 per 64 values: value j (low), value j + 32 (high)
        byte, shift = (e // 64) * 32 + e % 32, 4 * ((e % 64) // 32)
    else:   # Q6_K: byte j of 64 per 128 values: value j (low), value j + 64 (high)
        byte, shift = (e // 128) * 64 + e % 64, 4 * ((e % 128) // 64)
    return (w.planes["q"][:, byte].int() >> shift) & 15


def dequantize(w: GgufPlanes) -> torch.Tensor:
    """The planes expanded to fp32 [n, k], with the same arithmetic as the file format defines."""
    p, k = w.planes, w.k
    e = torch.arange(k, device=p["q"].device)
    if w.type_name == "Q8_0":
        return p["q"].float() * p["s"].float()[:, e // 32]
    q = _low_bits(w)
    if w.type_name == "Q4_0":
        return p["s"].float()[:, e // 32] * (q - 8).float()
    if w.type_name == "Q4_1":
        return p["s"].float()[:, e // 32] * q.float() + p["m"].float()[:, e // 32]
    if w.type_name == "Q6_K":   # 2 high bits: byte j of 32 per 128 values, bit pair by the value's quarter
        high = (p["h"][:, (e // 128) * 32 + e % 32].int() >> (2 * ((e % 128) // 32))) & 3
        scale = p["d"].float()[:, e // 256] * p["s"].float()[:, e // 16]
        return scale * ((q | (high << 4)) - 32).float()
    if w.type_name == "Q5_K":   # 1 high bit: byte j of 32 per 256 values, bit by the value's block of 32
        q = q | (((p["h"][:, (e // 256) * 32 + e % 32].int() >> ((e % 256) // 32)) & 1) << 4)
    scale = p["d"].float()[:, e // 256] * p["s"].float()[:, e // 32]
    minimum = p["dm"].float()[:, e // 256] * p["m"].float()[:, e // 32]
    return scale * q.float() - minimum


@dataclass
class Int4Weight:
    """A 4-bit GGUF weight [n, k] (INT4_TYPES) in the W4A16 kernels' layout, groups (and runs) of 32
    inputs: planes "words" int32 [n, padded(k) / 8], "scales" fp16 [k / 32, n] and "zeros" [k / 32,
    n]: uint8 zero points for Q4_0 (8: d (q - 8)), fp16 mins for Q4_1 and Q4_K (q s - m)."""
    n: int
    k: int
    planes: dict[str, torch.Tensor]
    group = run = 32

    def args(self) -> tuple:
        """The W4A16 kernels' weight arguments."""
        p = self.planes
        return p["words"], p["scales"], p["zeros"], self.k, self.group, self.run


def rows(w: GgufPlanes | Int4Weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64 [T]) of a weight as gpu_weight holds it, expanded to fp32 [T, k], contiguous
    (a TP embedding all-reduces it): an embedding lookup that leaves the table in its blocks (torch
    ops, capturable in a CUDA graph)."""
    if isinstance(w, GgufPlanes):
        return dequantize(GgufPlanes(w.type_name, ids.numel(), w.k, {name: p.index_select(0, ids)
                                                                     for name, p in w.planes.items()}))
    p = w.planes
    q = int4_layout.unpack(p["words"].index_select(0, ids), w.k, w.run).t()          # [T, k]
    group = torch.arange(w.k, device=ids.device) // w.group
    return int4_layout.values(q, p["scales"].index_select(1, ids).t()[:, group],
                              p["zeros"].index_select(1, ids).t()[:, group]).contiguous()   # q is transposed


def _scales_and_mins(w: GgufPlanes) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of 32 and row, [n, k / 32]: the W4A16 form's fp16 scale and zero point (Q4_0) or
    min (w = q s - m). Q4_0 and Q4_1 as the file holds them; Q4_K's d * scale and dmin * min
    (products of an fp16 and a 6-bit integer) rounded once to fp16, a relative 2^-11 at most, well
    inside the bf16 activations' rounding."""
    p = w.planes
    if w.type_name == "Q4_0":
        return p["s"], torch.full_like(p["s"], 8, dtype=torch.uint8)
    if w.type_name == "Q4_1":   # d q + min
        return p["s"], -p["m"]
    sub = torch.arange(w.k // 32, device=p["s"].device) // 8   # Q4_K: the super-block of each block
    return ((p["d"].float()[:, sub] * p["s"].float()).half(), (p["dm"].float()[:, sub] * p["m"].float()).half())


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")   # the types gpu_weight puts in the W4A16 layout


def int4_values(raw: torch.Tensor, type_name: str, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit weight's blocks (INT4_TYPES) -> (values int32 [n, k], fp16 scales [n, k / 32], zero
    points uint8 (Q4_0) or fp16 mins [n, k / 32]): w = (q - z) s or q s - m per block of 32, for
    layouts other than gpu_weight's (kernels/moe/int4_experts.py's)."""
    planes = to_planes(raw, type_name, k)
    return (_low_bits(planes), *_scales_and_mins(planes))


def gpu_bits(type_name: str, exact: bool = False) -> float:
    """Bits per weight `gpu_weight` holds for one of INT4_TYPES (K a multiple of 256): 4 for the
    quants, 16 / 32 for the fp16 scale, 8 / 32 (Q4_0's zero point) or 16 / 32 (a min); Q4_K kept
    `exact` as planes: 4 + 2 x 8 / 32 for its byte scale and min + 2 x 16 / 256 for d and dmin."""
    if exact and type_name == "Q4_K":
        return 4.625
    return 4.75 if type_name == "Q4_0" else 5.0


CHUNK_ROWS = 16384   # gpu_weight repacks a weight this many rows at a time (its int64 temporaries: ~8 x the rows' k)


def gpu_weight(raw: torch.Tensor, type_name: str, k: int, exact: bool = False) -> GgufPlanes | Int4Weight:
    """The file's blocks as the GPU kernels take them: INT4_TYPES in the W4A16 layout, the rest as
    planes; Q4_K as planes too where `exact` (an fp32 model: no scale rounded) or a scale overflows
    fp16. Large weights (an embedding table) are repacked CHUNK_ROWS rows at a time."""
    if raw.shape[0] > CHUNK_ROWS:
        parts = [gpu_weight(raw[i:i + CHUNK_ROWS], type_name, k, exact) for i in range(0, raw.shape[0], CHUNK_ROWS)]
        if len({type(p) for p in parts}) == 1:   # (a chunk whose Q4_K scale overflowed fp16 stays planes)
            axis = {"scales": 1, "zeros": 1} if isinstance(parts[0], Int4Weight) else {}
            planes = {name: torch.cat([p.planes[name] for p in parts], axis.get(name, 0))
                      for name in parts[0].planes}
            return dataclasses.replace(parts[0], n=raw.shape[0], planes=planes)
        return gpu_weight(raw, type_name, k, exact=True)   # Q4_K: all of it as planes then
    planes = to_planes(raw, type_name, k)
    if type_name not in INT4_TYPES or (exact and type_name == "Q4_K"):
        return planes
    scales, zeros = _scales_and_mins(planes)
    if not (scales.isfinite().all() and (zeros.dtype != torch.float16 or zeros.isfinite().all())):
        return planes
    return Int4Weight(planes.n, k, {"words": int4_layout.pack(_low_bits(planes).t(), 32),
                                    "scales": scales.t().contiguous(), "zeros": zeros.t().contiguous()})
