"""Paged attention on CUDA through Triton kernels: decodes (K/V read in place through the block
tables), every prefill chunk of a step in one launch (cached prefixes read in place too), and the
new K/V written with one kernel. Everything a decode step does has static shapes, so decode steps
can be captured in CUDA graphs (worker/cuda_graphs.py). An fp8 pool (`--kv-cache-dtype fp8`) goes
through the same kernels with the layer's k_scale / v_scale (kernels/attention/triton_paged.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from shardserve.layers.attention.backend import AttentionSpec, CommonAttentionMetadata
from shardserve.layers.attention.torch_ref import TorchAttentionBackend, TorchAttentionMetadata
from shardserve.transfer import to_device

# Decode-only steps: the attention kernel rotates q and k and stores the new K/V itself (=0: the
# rotary + K/V write kernel first, for A/B runs).
ROPE_IN_DECODE = os.environ.get("SHARDSERVE_ROPE_IN_DECODE", "1") != "0"


@dataclass
class CudaDecodes:
    block_tables: torch.Tensor   # [num_decodes, max_blocks] int32
    seq_lens: torch.Tensor       # [num_decodes] int32


class CudaAttentionBackend(TorchAttentionBackend):
    name = "cuda-triton"

    @staticmethod
    def supports(spec: AttentionSpec, block_size: int) -> bool:
        from shardserve.kernels.attention.triton_decode import supported
        return supported(spec.head_dim, block_size)

    def _build_decodes(self, common: CommonAttentionMetadata, device: torch.device) -> CudaDecodes:
        d = common.num_decodes
        return CudaDecodes(common.block_tables[:d].to(device=device, dtype=torch.int32),
                           to_device([c + 1 for c in common.context_lens[:d]], torch.int32, device))   # pinned

    def _build_prefills(self, common: CommonAttentionMetadata, prefills, device: torch.device):
        from shardserve.kernels.attention.prefill_tiles import build_prefill_tiles
        return build_prefill_tiles([p.token_start for p in prefills], [p.query_len for p in prefills],
                                   [p.context_len for p in prefills], common.block_tables[common.num_decodes:], device)

    def _prefills(self, spec, q, k, v, k_cache, v_cache, md: TorchAttentionMetadata, out) -> None:
        from shardserve.kernels.attention.triton_prefill import paged_prefill_attention
        paged_prefill_attention(q, k_cache, v_cache, md.prefill_batch, out, spec.scale, spec.sliding_window,
                                spec.k_scale, spec.v_scale)

    def forward(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: TorchAttentionMetadata, rotary=None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if rotary is None or md.has_prefills or not md.num_decodes or not ROPE_IN_DECODE:
            return super().forward(spec, q, k, v, kv_cache, md, rotary, out)
        # A decode-only step (every decode graph): the attention kernel itself rotates q and k and
        # stores the new K/V, one launch instead of two.
        from shardserve.kernels.attention.triton_decode import paged_decode_attention
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_decode_attention(q, kv_cache[0], kv_cache[1], md.decodes.block_tables, md.decodes.seq_lens, out,
                               spec.scale, spec.sliding_window, rope=(rotary[0], k, v, rotary[1], rotary[2], md.slots),
                               k_scale=spec.k_scale, v_scale=spec.v_scale)
        return out

    def fuses_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        from shardserve.kernels.rope.triton_rope import fusable
        return fusable(q, k, v)

    def _write(self, q, k, v, k_cache, v_cache, md: TorchAttentionMetadata, rotary,
               spec: AttentionSpec | None = None) -> None:
        from shardserve.kernels.attention.triton_decode import write_kv
        scales = (spec.k_scale, spec.v_scale) if spec is not None else (1.0, 1.0)
        if rotary is not None:   # one kernel: rotate q and k in place, store k and v
            from shardserve.kernels.rope.triton_rope import rotary_and_write_kv
            rotary_and_write_kv(rotary[0], q, k, v, rotary[1], rotary[2], k_cache, v_cache, md.slots, *scales)
            return
        if k.stride(2) != 1 or v.stride(2) != 1:
            k, v = k.contiguous(), v.contiguous()
        write_kv(k, v, k_cache, v_cache, md.slots, *scales)

    def _decodes(self, spec, q, k_cache, v_cache, md: TorchAttentionMetadata, out) -> None:
        from shardserve.kernels.attention.triton_decode import paged_decode_attention
        n = md.num_decodes
        paged_decode_attention(q[:n], k_cache, v_cache, md.decodes.block_tables, md.decodes.seq_lens, out[:n],
                               spec.scale, spec.sliding_window, k_scale=spec.k_scale, v_scale=spec.v_scale)


def prefill_metadata(slots: torch.Tensor, tiles, block_size: int) -> TorchAttentionMetadata:
    """Metadata for a prefill-only step built from (static) device tensors, for graphs: the chunks
    are described by `tiles` (prefill_tiles.PrefillTiles) alone."""
    return TorchAttentionMetadata(slots, block_size, 0, None, [], tiles)


def decode_metadata(slots: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    block_size: int) -> TorchAttentionMetadata:
    """Metadata for a decode-only step built straight from (static) device tensors, for graphs."""
    return TorchAttentionMetadata(slots, block_size, slots.shape[0],
                                  CudaDecodes(block_tables, seq_lens), [])
