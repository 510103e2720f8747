"""INT4 (GPTQ / AWQ) mixture-of-experts weights: Qwen3-MoE, Mixtral and OLMoE checkpoints whose experts
GPTQModel / AutoGPTQ or AutoAWQ quantized one expert at a time, stored per expert as the dense layers
are (`...experts.N.gate_proj.qweight / qzeros / scales [/ g_idx]`, Mixtral `w1 / w3 / w2`; the
packings of quantization/int4.py). The router (`mlp.gate`) stays full precision, as the tools leave it.

- Loaded: per expert into stacked tensors still in the checkpoint's packing (`w13_qweight` ...), each
  rank cutting its own slice: gate / up rows over TP (the packed qzeros and AWQ qweight in words of
  8 outputs, hence intermediate rows per rank a multiple of 8), w2's inputs over TP (GPTQ qweight in
  words of 8 inputs). A TP split of w2 that cuts a group is fine: the rank keeps the scale / zero rows
  of the groups its inputs touch, first and last one shared with its neighbours, and numbers its
  inputs' groups from there. With `desc_act` it keeps every group and the inputs' g_idx.
  Under expert parallelism each rank takes whole experts (FusedMoE's expert range).
- Converted after loading, expert by expert, into kernels/moe/int4_experts.py's layout (why that
  one and not the dense kernels': see there): 4-bit values packed along K, fp16 (or fp32) scales and
  uint8 zeros per group, the inputs' group index (one shared row, or per expert with desc_act).
- Running: CUDA with bf16 / fp16 activations, the fused Triton kernel unpacks the words in registers
  (kernels/moe/triton_moe_int4.py); elsewhere the grouped torch path dequantizes one expert at a
  time for its own matmul (kernels/moe/torch_moe.py). Either way memory stays at INT4: ~0.27x bf16's
  expert bytes at group 128.
- Refused, naming the layer: intermediate rows per rank not a multiple of 8 (with the TP sizes that
  work), experts stacked in one tensor, gate and up of one expert with different activation orders,
  a nonzero expert bias (AutoGPTQ's all-zero ones are read and dropped).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from shardserve.kernels.moe.int4_experts import Int4Experts, pack_along_k
from shardserve.kernels.quant.int4_layout import compact_scales
from shardserve.layers.moe import FusedMoE, MoEMethod, experts_matmul
from shardserve.quantization.int4 import PACK, Int4Config, unpack_int4


@dataclass(frozen=True)
class _Part:
    """One stacked matrix on this rank: n outputs, k inputs starting at input `offset` of k_full."""
    name: str           # "w13" | "w2"
    n: int
    k: int
    k_full: int
    offset: int
    group: int          # inputs per group (k_full when the checkpoint has one group)
    first_group: int    # the first group this rank holds
    groups: int         # how many it holds


def _valid_tp_sizes(full_inter: int) -> list[int]:
    return [d for d in range(1, full_inter + 1) if full_inter % d == 0 and (full_inter // d) % PACK == 0]


class Int4MoEMethod(MoEMethod):
    def __init__(self, config: Int4Config) -> None:
        self.config = config
        self.gptq = config.name == "gptq"

    def _part(self, name: str, n: int, k: int, k_full: int, offset: int) -> _Part:
        group = self.config.group_size or k_full
        if self.config.desc_act:   # any input may be in any group: keep them all
            return _Part(name, n, k, k_full, offset, group, 0, -(-k_full // group))
        first, last = offset // group, (offset + k - 1) // group
        return _Part(name, n, k, k_full, offset, group, first, last - first + 1)

    def create_weights(self, layer: FusedMoE) -> None:
        e, inter, hidden = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
        shards = layer.inter_shards
        if inter % PACK or hidden % PACK:
            raise ValueError(
                f"{self.config.name.upper()} experts of {layer.prefix}: {inter} intermediate rows per rank (and "
                f"{hidden} hidden) must be multiples of 8 (4-bit values are packed 8 to a word); tensor_parallel_size "
                f"values that work: {_valid_tp_sizes(inter * shards)}, or --enable-expert-parallel")
        layer.packed_expert_weights = ()   # nothing for the native CPU GEMM to repack
        self.parts = (self._part("w13", 2 * inter, hidden, hidden, 0),
                      self._part("w2", hidden, inter, inter * shards, layer.inter_rank * inter))
        for part in self.parts:
            k, n = part.k, part.n
            qshape = (e, k // PACK, n) if self.gptq else (e, k, n // PACK)
            self._register(layer, part, "qweight", torch.empty(qshape, dtype=torch.int32))
            self._register(layer, part, "qzeros", torch.empty(e, part.groups, n // PACK, dtype=torch.int32))
            self._register(layer, part, "scales", torch.empty(e, part.groups, n, dtype=torch.float32))
            if self.gptq:   # optional (a buffer with a loader): read only with desc_act
                g_idx = torch.zeros(e, k, dtype=torch.int32)
                layer.register_buffer(f"{part.name}_g_idx", g_idx, persistent=False)
                g_idx.weight_loader = self._loader(layer, part, "g_idx")
                g_idx.int4_loaded = set()
            # AutoGPTQ writes a bias of zeros beside every quantized projection: read, checked, dropped.
            bias = torch.zeros(1)
            layer.register_buffer(f"{part.name}_bias", bias, persistent=False)
            bias.weight_loader, bias.full_precision = self._zero_bias(layer), True

    def _register(self, layer: FusedMoE, part: _Part, field: str, data: torch.Tensor) -> None:
        param = layer.register_expert_param(f"{part.name}_{field}", data)
        param.weight_loader = self._loader(layer, part, field)
        param.full_precision = field == "scales"   # fp16 checkpoint scales, never rounded to bf16

    def _checkpoint_slice(self, layer: FusedMoE, part: _Part, field: str, loaded: torch.Tensor,
                          kind: str) -> torch.Tensor:
        """This rank's piece of one expert's checkpoint tensor (shapes: quantization/int4.py)."""
        if part.name == "w13":   # outputs split over TP: the last dim, in words where packed along it
            if field == "g_idx":
                return loaded
            per_word = PACK if field == "qzeros" or (field == "qweight" and not self.gptq) else 1
            rows = layer.intermediate_size // per_word
            return loaded.narrow(-1, layer.inter_rank * rows, rows)
        if field in ("qzeros", "scales"):   # w2: the groups this rank's inputs touch
            expected = -(-part.k_full // part.group)
            if loaded.shape[0] != expected:
                raise ValueError(f"{layer.prefix}: an expert's down {field} has {loaded.shape[0]} groups; "
                                 f"expected {expected} ({part.k_full} inputs, group_size {part.group})")
            return loaded.narrow(0, part.first_group, part.groups)
        per_word = PACK if field == "qweight" and self.gptq else 1   # w2's inputs split over TP
        return loaded.narrow(0, part.offset // per_word, part.k // per_word)

    @staticmethod
    def _zero_bias(layer: FusedMoE) -> Callable[..., None]:
        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int | None, str]) -> None:
            if torch.count_nonzero(loaded):
                raise ValueError(f"{layer.prefix}: expert {shard_id[0]}'s {shard_id[1]} projection has a nonzero "
                                 "bias; biased experts are not supported")
        return load

    def _loader(self, layer: FusedMoE, part: _Part, field: str) -> Callable[..., None]:
        fmt = self.config.name.upper()

        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int | None, str]) -> None:
            expert, kind = shard_id
            if expert is None or kind == "gate_up":
                raise ValueError(f"{layer.prefix}: {fmt} experts stacked in one tensor are not supported; "
                                 "give per-expert tensors (experts.N.gate_proj.qweight ...) as GPTQ / AWQ tools write")
            local = expert - layer.expert_start
            if not 0 <= local < layer.num_local_experts:   # another expert-parallel rank's expert
                return
            src = self._checkpoint_slice(layer, part, field, loaded, kind)
            dst = param.data[local]
            if field == "g_idx" and kind in ("gate", "up"):   # one input order for both (as dense fused parts)
                if local in param.int4_loaded and not torch.equal(dst, src.to(dst.device, dst.dtype)):
                    raise ValueError(f"{layer.prefix}: g_idx of expert {expert}'s {kind} differs from its "
                                     "other projection's (desc_act with different input orders for gate and up is "
                                     "not supported)")
                param.int4_loaded.add(local)
            elif field == "g_idx":
                param.int4_loaded.add(local)
            elif kind in ("gate", "up"):
                width = dst.shape[-1] // 2
                dst = dst.narrow(-1, 0 if kind == "gate" else width, width)
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"{layer.prefix}: expert {expert}'s {kind} {field} {tuple(loaded.shape)} does not fit "
                                 f"this layer ({fmt}, group_size {self.config.group_size or -1}): this rank expects "
                                 f"{tuple(dst.shape)} of it")
            dst.copy_(src)
        return load

    def process_after_loading(self, layer: FusedMoE) -> None:
        for part in self.parts:
            self._convert(layer, part)

    def _group_index(self, layer: FusedMoE, part: _Part) -> torch.Tensor:
        e, device = layer.num_local_experts, getattr(layer, f"{part.name}_scales").device
        if self.config.desc_act:
            g_idx = getattr(layer, f"{part.name}_g_idx")
            if len(g_idx.int4_loaded) != e:
                raise ValueError(f"{layer.prefix}: the checkpoint orders inputs by activation (GPTQ desc_act, "
                                 "compressed-tensors actorder group) but has no g_idx for some of its experts' "
                                 f"{'gate/up' if part.name == 'w13' else 'down'} projections")
            if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= part.groups):
                raise ValueError(f"{layer.prefix}: g_idx names groups outside 0..{part.groups - 1}")
            return g_idx.contiguous()
        k = torch.arange(part.offset, part.offset + part.k, device=device)
        return (k // part.group - part.first_group).to(torch.int32).expand(e, part.k)   # one row, stride 0

    def _convert(self, layer: FusedMoE, part: _Part) -> None:
        name = part.name
        qweight, qzeros = getattr(layer, f"{name}_qweight").data, getattr(layer, f"{name}_qzeros").data
        e = qweight.shape[0]
        index = self._group_index(layer, part)
        words = torch.empty(e, part.n, part.k // PACK, dtype=torch.int32, device=qweight.device)
        for expert in range(e):   # one expert at a time: the unpacked temporaries stay one expert's size
            if self.gptq:         # GPTQ packs 8 consecutive inputs per word already: only transposed
                words[expert] = qweight[expert].t()
            else:
                words[expert] = pack_along_k(unpack_int4(qweight[expert], 1, interleaved=True).t())
        zeros = unpack_int4(qzeros.reshape(-1, qzeros.shape[-1]), 1, interleaved=not self.gptq)
        zeros = ((zeros + self.config.zero_offset) & 15).to(torch.uint8).view(e, part.groups, part.n)
        scales = compact_scales(getattr(layer, f"{name}_scales").data)
        for field in ("qweight", "qzeros", "scales", "g_idx", "bias"):
            if hasattr(layer, f"{name}_{field}"):
                delattr(layer, f"{name}_{field}")
        layer.register_parameter(f"{name}_qweight", nn.Parameter(words, requires_grad=False))
        layer.register_parameter(f"{name}_scales", nn.Parameter(scales, requires_grad=False))
        layer.register_parameter(f"{name}_zeros", nn.Parameter(zeros, requires_grad=False))
        layer.register_buffer(f"{name}_group_index", index, persistent=False)

    def experts(self, layer: FusedMoE, part: _Part) -> Int4Experts:
        regular = not self.config.desc_act   # then group_index[k] = (k + phase) // group
        return Int4Experts(getattr(layer, f"{part.name}_qweight"), getattr(layer, f"{part.name}_scales"),
                           getattr(layer, f"{part.name}_zeros"), getattr(layer, f"{part.name}_group_index"),
                           group_size=part.group if regular else 0,
                           group_phase=part.offset % part.group if regular else 0)

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = (self.experts(layer, part) for part in self.parts)
        return experts_matmul(hidden, w13, w2, topk_weights, topk_ids)
