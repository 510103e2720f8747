"""Paged attention on x86 CPUs through the native kernels in kernels/cpu/csrc/cpu_ops.c.

Every new token (a decode, or one token of a prefill chunk) is one query that reads the keys and
values at positions 0..its own through its request's block table, straight from the paged pool:
no gather into padded batches, no masks, no per-request SDPA calls. A prefill token is thus
computed exactly as if it had been decoded, so chunked prefill, prefix-cache hits and batching
change no bit of a request's result. The pool may be bf16 while the model computes in fp32: half
the bytes to read, widened in registers; or fp8 E4M3 (`--kv-cache-dtype fp8`, the layer's k_scale /
v_scale): a quarter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.kernels.cpu import cpu_ops
from shardserve.layers.attention.backend import AttentionSpec, CommonAttentionMetadata
from shardserve.layers.attention.torch_ref import TorchAttentionBackend


@dataclass
class NativeAttentionMetadata:
    slots: torch.Tensor          # [T] int64: where each new token's K/V goes
    block_tables: torch.Tensor   # [T, max_blocks] int32: each token's request's table
    seq_lens: torch.Tensor       # [T] int32: keys each token attends to (its position + 1)


class CpuNativeAttentionBackend(TorchAttentionBackend):
    name = "cpu-native"

    @staticmethod
    def supports(spec: AttentionSpec, kv_cache_dtype: torch.dtype) -> bool:
        return (cpu_ops.available() and spec.head_dim % 8 == 0
                and kv_cache_dtype in cpu_ops.KV_KINDS)

    def build(self, common: CommonAttentionMetadata, device: torch.device) -> NativeAttentionMetadata:
        query_lens = torch.tensor(common.query_lens)
        request = torch.repeat_interleave(torch.arange(len(common.query_lens)), query_lens)
        first_token = torch.cumsum(query_lens, 0) - query_lens
        # token j of request r sits at position context_lens[r] + j and sees that many keys plus itself
        seq_lens = torch.tensor(common.context_lens)[request] + torch.arange(len(request)) - first_token[request] + 1
        return NativeAttentionMetadata(common.slot_mapping, common.block_tables.index_select(0, request).contiguous(),
                                       seq_lens.to(torch.int32))

    def forward(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: NativeAttentionMetadata, rotary=None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if q.dtype != torch.float32:
            # Native half-precision compute (SHARDSERVE_CPU_NATIVE_HALF=1): the kernels take fp32
            # rows, so q, k, v are widened (exactly) and the result rounded once, as SDPA would.
            result = self.forward(spec, q.float(), k.float(), v.float(), kv_cache, md)
            if out is None:
                return result.to(q.dtype)
            return out.copy_(result)
        cpu_ops.write_kv(k, v, k_cache, v_cache, md.slots, spec.k_scale, spec.v_scale)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        cpu_ops.paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, out, spec)
        return out
