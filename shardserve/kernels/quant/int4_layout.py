"""The INT4 weight layout the W4A16 kernels read (kernels/quant/triton_w4a16.py), made once after
loading from the values a GPTQ or AWQ checkpoint holds (quantization/int4.py unpacks those).

Per output row, the inputs are cut into blocks of 8 runs of RUN inputs (RUN = 128 for groups of 128
inputs or more, else the group: 64 or 32); a block is RUN int32 words and nibble i of word w holds
input RUN * i + w of the block. So one load of RUN words per row (512 bytes at RUN 128) brings a
whole block, and the block's nibble i across its words is a run of RUN consecutive inputs inside
one group, which the kernels multiply with RUN consecutive activations after one scale and zero.
K is padded with zeros to whole blocks (the kernels mask the activations there).

Beside it: per group and output a scale (fp16 when every scale is one exactly, else fp32) and the
zero point as uint8, both [groups, N]; the input order of the kernel's K (a GPTQ `desc_act`
checkpoint's inputs sorted by group, so each group is again a run); the group size and RUN.
"""
from __future__ import annotations

import torch

MAX_RUN = 128


def padded(k: int, run: int) -> int:
    return -(-k // (8 * run)) * 8 * run


def pack(q: torch.Tensor, run: int) -> torch.Tensor:
    """Values q [K, N] (0..15, in the kernel's input order) -> int32 words [N, padded(K) / 8]."""
    k, n = q.shape
    v = torch.zeros(padded(k, run), n, dtype=torch.int64, device=q.device)
    v[:k] = q
    v = v.view(-1, 8, run, n).permute(3, 0, 2, 1)                          # [N, blocks, word, nibble]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (v << shifts).sum(-1).reshape(n, -1)                            # unsigned 32-bit values
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack(words: torch.Tensor, k: int, run: int) -> torch.Tensor:
    """The inverse of pack: int32 words [N, padded(K) / 8] -> values [K, N] (int32)."""
    n = words.shape[0]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    v = (words.view(n, -1, run, 1) >> shifts) & 15                          # [N, blocks, word, nibble]
    return v.permute(1, 3, 2, 0).reshape(-1, n)[:k]


def values(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """fp32 weights from values q and, elementwise, their group's scale and zero point ((q - z) s)
    or, where `zeros` is fp16, min (q s - m: GGUF's Q4_1 / Q4_K in this layout)."""
    if zeros.dtype == torch.float16:
        return q.float() * scales.float() - zeros.float()
    return (q - zeros.int()).float() * scales.float()


def compact_scales(scales: torch.Tensor) -> torch.Tensor:
    """fp16 when it holds every scale exactly (fp16 checkpoints: the usual case), else fp32."""
    half = scales.half()
    return half if torch.equal(half.float(), scales.float()) else scales.float()


def kernel_group(group: int, k: int) -> tuple[int, int] | None:
    """(group size, RUN) the kernels take for groups of `group` inputs over K inputs, or None when
    they cannot: a group must be 32 or 64 inputs, a multiple of 128, or span all of K."""
    if group >= k:
        return padded(k, MAX_RUN), MAX_RUN   # one group: any multiple of the block works
    if group % MAX_RUN == 0:
        return group, MAX_RUN
    return (group, group) if group in (32, 64) else None
