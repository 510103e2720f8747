"""The INT4 weight layout the W4A16 kernels read (kernels/quant/triton_w4a16.py), made once after
loading from the values a GPTQ or AWQ checkpoint holds (quantization/int4.py unpacks those).

Per output row, the inputs are cut into blocks of 256; a block is 32 int32 words (128 bytes) and
nibble i of word w holds input 32 * i + w of the block. So one 128-byte load per row brings a whole
block, and the block's nibble i across its 32 words is a run of 32 consecutive inputs, which the
kernels multiply with 32 consecutive activations (a group of 32, 64 or 128 inputs is a whole number
of such runs). K is padded with zeros to a multiple of 256 (the kernels mask the activations there).

Beside it: per group and output a scale (fp16 when every scale is one exactly, else fp32) and the
zero point as uint8, both [groups, N]; the input order of the kernel's K (a GPTQ `desc_act`
checkpoint's inputs sorted by group, so each group is again a run); the group size.
"""
from __future__ import annotations

import torch

BLOCK = 256          # inputs per block of 32 words
WORDS = BLOCK // 8   # int32 words per block (and inputs per run)


def padded(k: int) -> int:
    return -(-k // BLOCK) * BLOCK


def pack(q: torch.Tensor) -> torch.Tensor:
    """Values q [K, N] (0..15, in the kernel's input order) -> int32 words [N, padded(K) / 8]."""
    k, n = q.shape
    v = torch.zeros(padded(k), n, dtype=torch.int64, device=q.device)
    v[:k] = q
    v = v.view(-1, 8, WORDS, n).permute(3, 0, 2, 1)                        # [N, blocks, word, nibble]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (v << shifts).sum(-1).reshape(n, -1)                            # unsigned 32-bit values
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack(words: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of pack: int32 words [N, padded(K) / 8] -> values [K, N] (int32)."""
    n = words.shape[0]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    v = (words.view(n, -1, WORDS, 1) >> shifts) & 15                        # [N, blocks, word, nibble]
    return v.permute(1, 3, 2, 0).reshape(-1, n)[:k]


def compact_scales(scales: torch.Tensor) -> torch.Tensor:
    """fp16 when it holds every scale exactly (fp16 checkpoints: the usual case), else fp32."""
    half = scales.half()
    return half if torch.equal(half.float(), scales.float()) else scales.float()


def kernel_group(group: int, k: int) -> int | None:
    """The group size the kernels take for groups of `group` inputs over K inputs, or None when
    they cannot: a group must be a whole number of runs of 32 that tiles the blocks (up to 256, or
    a multiple of 256), or span all of K."""
    if group >= k:
        return padded(k)   # one group: any multiple of the block works
    fits = group % WORDS == 0 and (group <= BLOCK and BLOCK % group == 0 or group % BLOCK == 0)
    return group if fits else None
