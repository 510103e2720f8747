"""Paged attention on x86 CPUs through the native kernels in layers/csrc/cpu_ops.c.

Decodes read K/V straight from the paged pool through the block tables (no gather into padded
batches, no masks), each (request, KV head) computed on its own, so a request's result does not
depend on the batch around it. The pool may be bf16 while the model computes in fp32: half the
bytes to read per decoded token, widened in registers. Prefill chunks keep the plain-torch path
(SDPA over the chunk and any cached prefix), which is GEMM-bound and already fast on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.layers import cpu_ops
from shardserve.layers.attention.backend import AttentionSpec, CommonAttentionMetadata
from shardserve.layers.attention.torch_ref import TorchAttentionBackend, TorchAttentionMetadata


@dataclass
class _NativeDecodes:
    block_tables: torch.Tensor   # [num_decodes, max_blocks] int32, contiguous
    seq_lens: torch.Tensor       # [num_decodes] int32


class CpuNativeAttentionBackend(TorchAttentionBackend):
    name = "cpu-native"

    @staticmethod
    def supports(spec: AttentionSpec, kv_cache_dtype: torch.dtype) -> bool:
        return (cpu_ops.available() and spec.head_dim % 8 == 0
                and kv_cache_dtype in (torch.float32, torch.bfloat16))

    def _build_decodes(self, common: CommonAttentionMetadata, device: torch.device) -> _NativeDecodes:
        d = common.num_decodes
        lens = [c + 1 for c in common.context_lens[:d]]
        return _NativeDecodes(common.block_tables[:d].to(torch.int32).contiguous(),
                              torch.tensor(lens, dtype=torch.int32))

    def _write(self, k, v, k_cache, v_cache, md: TorchAttentionMetadata) -> None:
        cpu_ops.write_kv(k, v, k_cache, v_cache, md.slots)

    def _decodes(self, spec, q, k_cache, v_cache, md: TorchAttentionMetadata, out) -> None:
        cpu_ops.paged_decode_attention(q[:md.num_decodes], k_cache, v_cache, md.decodes.block_tables,
                                       md.decodes.seq_lens, out[:md.num_decodes], spec)
