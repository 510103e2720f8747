"""GGUF mixture-of-experts weights kept in their blocks, as the CPU's grouped expert path reads them
(torch_moe.py, one expert at a time); quantization/gguf_moe.py makes them from a GGUF file's stacked
`ffn_{gate,up,down}_exps` tensors.

One stacked matrix (w13 or w2: E experts, N outputs, K inputs) is held per expert in the layout the
block kernels take (kernels/cpu/quant_ops.py): regrouped in 8-row groups for the int8-activation
kernels (quant_ops.repack; `act` int16 or int8), or the file's rows for the fp32-activation ones
(`act` fp32). An expert's matmul reads only its own blocks, so the experts cost the file's bytes
in memory and a token's decode reads only its top-k experts' blocks. w13 (gate rows, then up rows)
runs gate, up and SiLU-and-mul in one kernel where the int8 kernels take it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.kernels.activation.reference import silu_and_mul
from shardserve.kernels.cpu import quant_ops


@dataclass(frozen=True)
class GgufExperts:
    blocks: torch.Tensor   # uint8 [E, ...]: each expert's blocks, contiguous
    type_name: str         # the GGUF type, e.g. "Q4_K"
    n: int                 # outputs per expert
    k: int                 # inputs
    isa: str               # SHARDSERVE_CPU_ISA as resolved at load
    act: str               # SHARDSERVE_GGUF_ACTIVATIONS as resolved at load (fp32: the file's rows)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(experts, outputs, inputs), as a stacked float weight's shape."""
        return self.blocks.shape[0], self.n, self.k

    @property
    def out_features(self) -> int:
        return self.n

    def matmul(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [T, K] (widened to fp32) @ expert's W^T -> fp32 [T, N]."""
        if not self.int8:
            return quant_ops.linear(x, self.blocks[expert], self.type_name, isa_name=self.isa)
        return quant_ops.linear_int8(x, self.blocks[expert], self.type_name, self.n, isa_name=self.isa, act=self.act)

    @property
    def int8(self) -> bool:
        """Regrouped for the int8-activation kernels (else the file's rows, fp32 activations)."""
        return self.act != "fp32"

    @property
    def gated_kernel(self) -> bool:
        """A w13 stack the int8 kernels' gated form takes (gate and up in whole 8-row groups)."""
        return self.int8 and self.n % 16 == 0

    @property
    def one_call(self) -> bool:
        """A w13 stack whose layer's picks run in one kernel call (quant_ops.moe_int8, with a w2 that
        takes the int8 kernels too)."""
        return self.gated_kernel

    def gated(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """silu(x gate^T) * (x up^T) of a w13 stack: fp32 [T, N / 2]."""
        if not self.gated_kernel:
            return silu_and_mul(self.matmul(x, expert))
        return quant_ops.linear_int8(x, self.blocks[expert], self.type_name, self.n, isa_name=self.isa, act=self.act,
                                     gated=True)

