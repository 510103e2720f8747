"""GGUF mixture-of-experts weights kept in their blocks on the CPU (`quantization_config.quant_method:
gguf`, models/gguf_loader.py): the stacked `ffn_{gate,up,down}_exps` tensors of a type the block
kernels multiply arrive as raw blocks, uint8 [experts, rows, blocks, block bytes] tagged with their
type, and stay so: most of a MoE model's bytes are its experts, and a decode step reads only the
picked experts' blocks (kernels/moe/gguf_experts.py runs them, one expert at a time).

- Loading (FusedMoE's shard ids (None, "gate" | "up" | "down"), every expert stacked): gate and up
  rows of this rank's experts fill w13's rows (sliced over TP like any column split); down's inputs,
  the intermediate dimension, are cut over TP in whole blocks (a split that would cut one is refused
  with the TP sizes that work).
- Parts of a type not kept arrive as values (the loader dequantizes them). After loading, the experts
  are kept where the device is the CPU, the block kernels are built, gate and up share one type
  and every part's type is one `kept_types()` names (as for the linears): regrouped for the
  int8-activation kernels (or the file's rows with SHARDSERVE_GGUF_ACTIVATIONS=fp32). On CUDA (not
  fp32) where gate and up share one type and every part is Q4_0, Q4_1 or Q4_K (and the GPU keeps
  it: quantization/gguf.py `gpu_keeps`): converted into kernels/moe/int4_experts.py's layout, groups
  of 32 with a zero point or an fp16 min, for the fused INT4 MoE kernel. Otherwise (other types,
  mixed gate/up types) the blocks are dequantized into the stacked float weights the unquantized
  paths run, as before this method existed.
"""
from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels.cpu import quant_ops
from shardserve.kernels.cpu.decoder_stack import StackMoe
from shardserve.kernels.moe import int4_experts, torch_moe
from shardserve.kernels.moe.gguf_experts import GgufExperts
from shardserve.kernels.quant import gguf_layout
from shardserve.layers.moe import FusedMoE, MoEMethod, experts_matmul
from shardserve.quantization.gguf import block_size, cpu_keeps, dequantize_blocks, gpu_keeps


class GgufMoEMethod(MoEMethod):
    def __init__(self) -> None:
        self.types: dict[str, str | None] = {}       # "gate" / "up" / "down" -> GGUF type (None: values)
        self._raw: dict[str, torch.Tensor] = {}      # the same -> this rank's blocks (or values) while loading
        self.kept: dict[str, GgufExperts] = {}       # "w13" / "w2" -> the experts in blocks, after loading
        self.int4: dict[str, int4_experts.Int4Experts] = {}   # the same on CUDA, 4-bit types, INT4 experts' layout
        self.dtype = torch.float32                   # the model's dtype, for experts dequantized after loading

    def create_weights(self, layer: FusedMoE) -> None:
        self.dtype = torch.get_default_dtype()   # the model is built under its dtype
        # Placeholders (the blocks' widths come with the tensors) of the model's dtype: the loader casts
        # experts that arrive as values (a type not kept) to it, and hands tagged blocks over as they are.
        for name in ("w13_weight", "w2_weight"):
            param = layer.register_expert_param(name, torch.empty(layer.num_local_experts, 0, dtype=self.dtype))
            param.weight_loader = lambda p, loaded, shard_id: self._load(layer, loaded, shard_id)

    def _load(self, layer: FusedMoE, loaded: torch.Tensor, shard_id: tuple[int | None, str]) -> None:
        expert, kind = shard_id
        type_name = getattr(loaded, "gguf_type", None)   # None: a type not kept, dequantized by the loader
        if expert is not None or loaded.dim() != (4 if type_name else 3):
            raise ValueError(f"{layer.prefix}: GGUF experts arrive stacked, as raw blocks (uint8 [experts, rows, "
                             f"blocks, bytes] tagged with their type) or values, got {tuple(loaded.shape)}")
        unit = block_size(type_name)[0] if type_name else 1
        inter, first = layer.intermediate_size, layer.expert_start
        local = loaded[first:first + layer.num_local_experts]
        if kind == "down":   # the inputs (intermediate) cut over TP, in whole blocks
            if inter % unit:
                full = inter * layer.inter_shards
                valid = [t for t in range(1, full // unit + 1) if full % (t * unit) == 0]
                raise ValueError(f"{layer.prefix}: GGUF {type_name} experts come in blocks of {unit} inputs; "
                                 f"splitting the intermediate size {full} over {layer.inter_shards} ranks cuts a "
                                 f"block. Tensor-parallel sizes that work: {valid} (or expert parallelism)")
            local = local.narrow(2, layer.inter_rank * (inter // unit), inter // unit)
        else:                # gate / up rows cut over TP
            local = local.narrow(1, layer.inter_rank * inter, inter)
        self._raw[kind] = local.contiguous()
        self.types[kind] = type_name

    def _values(self, kind: str, k: int, device: torch.device) -> torch.Tensor:
        """One part's experts as values: [E, rows, k] in the model's dtype (blocks dequantized one
        expert at a time)."""
        raw = self._raw[kind]
        if self.types[kind] is None:
            return raw.to(device=device, dtype=self.dtype)
        out = torch.empty(*raw.shape[:2], k, dtype=self.dtype, device=device)
        for i in range(raw.shape[0]):
            out[i] = dequantize_blocks(raw[i], self.types[kind], k).to(device=device, dtype=self.dtype)
        return out

    def process_after_loading(self, layer: FusedMoE) -> None:
        device = layer.w13_weight.device
        if set(self.types) != {"gate", "up", "down"}:
            raise ValueError(f"{layer.prefix}: the GGUF file lacks some of the experts' gate, up and down tensors")
        keep = (device.type == "cpu" and all(cpu_keeps(t) for t in self.types.values())
                and self.types["gate"] == self.types["up"])
        if (device.type == "cuda" and self.dtype != torch.float32 and self.types["gate"] == self.types["up"]
                and all(t in gguf_layout.INT4_TYPES and gpu_keeps(t) for t in self.types.values())):
            self._keep_int4(layer, device)
            return
        isa, act = quant_ops.isa(), quant_ops.activations()
        for part, kinds, k in (("w13", ("gate", "up"), layer.hidden_size), ("w2", ("down",), layer.intermediate_size)):
            if keep:
                raw = torch.cat([self._raw[kind] for kind in kinds], dim=1)   # gate rows, then up rows
                type_name, (e, n) = self.types[kinds[0]], raw.shape[:2]
                part_act = act if type_name in quant_ops.INT8_TYPES else "fp32"
                flat = raw.view(e, n, -1)
                held = (torch.stack([quant_ops.repack(flat[i], type_name, k) for i in range(e)])
                        if part_act != "fp32" else flat)
                self.kept[part] = GgufExperts(held, type_name, n, k, isa, part_act)   # shares the parameter's storage
            else:   # as before this method: the stacked float weights the unquantized paths run
                held = torch.cat([self._values(kind, k, device) for kind in kinds], dim=1)
            setattr(layer, f"{part}_weight", nn.Parameter(held, requires_grad=False))
        self._raw.clear()

    def _keep_int4(self, layer: FusedMoE, device: torch.device) -> None:
        """CUDA, every part Q4_0 / Q4_1 / Q4_K: the experts in kernels/moe/int4_experts.py's layout
        (groups of 32 with an fp16 scale and a zero point or an fp16 min), run by the fused INT4 MoE
        kernel."""
        for part, kinds, k in (("w13", ("gate", "up"), layer.hidden_size), ("w2", ("down",), layer.intermediate_size)):
            raw = torch.cat([self._raw[kind] for kind in kinds], dim=1)   # gate rows, then up rows
            experts = int4_experts.from_gguf_blocks(raw, self.types[kinds[0]], k, device)
            for name in ("qweight", "scales", "zeros"):   # parameters, so the layer's bytes count them
                layer.register_parameter(f"{part}_{name}", nn.Parameter(getattr(experts, name), requires_grad=False))
            layer.register_buffer(f"{part}_group_index", experts.group_index, persistent=False)
            self.int4[part] = experts
            setattr(layer, f"{part}_weight", nn.Parameter(torch.empty(experts.shape[0], 0, dtype=self.dtype,
                                                                      device=device), requires_grad=False))
        self._raw.clear()

    def stack_experts(self, layer: FusedMoE) -> StackMoe | None:
        """The one-call kernel `apply` runs (torch_moe.fused_moe's condition), for the decoder stack."""
        w13, w2 = self.kept.get("w13"), self.kept.get("w2")
        if w13 is None or w2 is None or not (w13.one_call and w2.int8):
            return None
        return quant_ops.stack_experts(w13.blocks, w13.type_name, w2.blocks, w2.type_name, w2.k, w13.isa, w13.act)

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if self.int4:   # CUDA, 4-bit types: the fused INT4 kernels
            return experts_matmul(hidden, self.int4["w13"], self.int4["w2"], topk_weights, topk_ids)
        if not self.kept:   # dequantized after loading: the unquantized experts' paths
            return experts_matmul(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        return torch_moe.fused_moe(hidden, self.kept["w13"], self.kept["w2"], topk_weights, topk_ids)
