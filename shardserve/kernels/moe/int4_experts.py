"""INT4 (W4A16) mixture-of-experts weights as every MoE path reads them (torch_moe.py one expert at a
time on the CPU, triton_moe_int4.py in registers on CUDA); quantization/int4_moe.py makes them from
GPTQ / AWQ checkpoints.

One stacked matrix (w13 or w2: E experts, N outputs, K inputs) is held as:
- `qweight` int32 [E, N, K / 8]: K innermost, word j of output row n holds inputs 8j .. 8j + 7, low
  nibble first (GPTQ's qweight transposed per expert; AWQ's repacked). Not the dense kernels'
  interleaved layout (kernels/quant/int4_layout.py): that one pads K to 1024-input blocks per row
  and is laid out for a one-row GEMV's 512-byte loads; the fused MoE kernel walks [BLOCK_K, BLOCK_N]
  tiles of many experts with a stride per expert, and 8 consecutive inputs per word make a tile's
  words one plain strided load with K never padded.
- `scales` [E, G, N] (fp16 when that holds every checkpoint scale exactly, else fp32) and `zeros`
  uint8 [E, G, N]: per group of inputs and output, N innermost so a tile's row is one coalesced load.
- `group_index` int32 [E, K]: the row of scales / zeros of each input. Without activation order it
  is k // group_size (shifted by where this rank's inputs start when TP cuts a group) and stored
  once, expanded over the experts (stride 0); with GPTQ `desc_act` it is each expert's g_idx.
So w[e, n, k] = (q[e, n, k] - zeros[e, g, n]) * scales[e, g, n], g = group_index[e, k], computed in
fp32 and rounded once to the activations' dtype (as quantization/int4.dequantize).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.kernels.quant import gguf_layout, int4_layout

PACK = 8   # 4-bit values per int32 word


def pack_along_k(q: torch.Tensor) -> torch.Tensor:
    """Values q [N, K] (0..15, K a multiple of 8) -> int32 words [N, K / 8], input 8j + i at bits 4i."""
    n, k = q.shape
    v = q.to(torch.int64).view(n, k // PACK, PACK) << torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = v.sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_along_k(words: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_along_k: int32 words [..., K / 8] -> values [..., K] (int32)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 15).flatten(-2)


@dataclass(frozen=True)
class Int4Experts:
    qweight: torch.Tensor       # int32 [E, N, K / 8]
    scales: torch.Tensor        # fp16 / fp32 [E, G, N]
    zeros: torch.Tensor         # uint8 [E, G, N]; fp16: mins (w = q s - m, GGUF's Q4_1 / Q4_K)
    group_index: torch.Tensor   # int32 [E, K] (stride 0 over E when shared)
    # Regular groups (no activation order): group_index[k] == (k + group_phase) // group_size, which
    # lets the CUDA kernel take one scale row per block; 0: use group_index alone.
    group_size: int = 0
    group_phase: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        """(experts, outputs, inputs) of the matrix these hold, as a stacked float weight's shape."""
        e, n, words = self.qweight.shape
        return e, n, words * PACK

    def dequantize(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """One expert's weight [N, K] in `dtype`: the only full-width copy the torch path makes."""
        q = unpack_along_k(self.qweight[expert])                    # [N, K]
        g = self.group_index[expert].long()
        return int4_layout.values(q, self.scales[expert].index_select(0, g).t(),
                                  self.zeros[expert].index_select(0, g).t()).to(dtype)

    def dequantize_all(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every expert [E, N, K] (tests and the oracle only)."""
        return torch.stack([self.dequantize(e, dtype) for e in range(self.shape[0])])


def from_gguf_blocks(raw: torch.Tensor, type_name: str, k: int, device: torch.device) -> Int4Experts:
    """GGUF experts of a 4-bit type (kernels/quant/gguf_layout.py INT4_TYPES; raw uint8 [E, N, bytes
    per row], any device) -> groups of 32 on `device`, with Q4_0's zero points or Q4_1 / Q4_K's fp16
    mins, converted one expert at a time so the temporaries stay one expert wide."""
    e, n = raw.shape[:2]
    words, scales, zeros = [], [], []
    for i in range(e):
        q, s, z = gguf_layout.int4_values(raw[i].reshape(n, -1).to(device), type_name, k)
        words.append(pack_along_k(q))
        scales.append(s.t())
        zeros.append(z.t())
    index = (torch.arange(k, device=device, dtype=torch.int32) // 32).expand(e, k)
    return Int4Experts(torch.stack(words), torch.stack(scales), torch.stack(zeros), index, group_size=32)
