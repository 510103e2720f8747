"""The sparse MLP of mixture-of-experts models: a router and the experts, as one layer models call.

`SparseMoeBlock` = `gate` (a replicated linear giving router logits) + `experts` (`FusedMoE`).
Routing is HF's: softmax over all experts, the top-k, optionally renormalised (kernels/moe/reference.py).

How the experts are split over ranks (weights: `w13` [experts, 2 * inter, hidden], gate rows then
up rows; `w2` [experts, hidden, inter]):
- Tensor parallel (default): every rank holds every expert, with the intermediate dimension split
  across TP, like a dense MLP's gate_up / down.
- Expert parallel (`--enable-expert-parallel`): the expert-parallel group (distributed/
  parallel_state.py) holds whole experts, num_experts / EP each; a pick of an expert held elsewhere
  becomes -1 here and adds nothing. The EP group is the TP group, or with data-parallel replicas
  every replica's TP group: then each layer first gathers all replicas' tokens (comm.
  dp_gather_tokens), runs this rank's experts on them, and hands each replica back the sum for its
  own rows (comm.dp_reduce_scatter_tokens). A replica with nothing to run still takes part
  (LlamaForCausalLM.idle_step).
Either way every rank's output is a partial sum over the TP group, reduced like RowParallelLinear's
(all-reduced, or handed to the next norm with `partial_sum=True`). The checkpoint's per-expert
tensors reach the stacked weights through `FusedMoE.weight_loader` with shard ids
(expert, "gate" | "up" | "down"); an expert of None means the tensor stacks all experts.

Quantized experts: built inside `linear_methods(factory)`, FusedMoE asks the factory for a
`MoEMethod` (quantization/fp8_moe.py, int4_moe.py), which registers the stacked weights in its format
plus their scales, converts them after loading and runs the experts. A scale parameter marked `expert_scale`
holds one value per output row of each expert ([experts, 2 * inter] for w13, [experts, hidden] for
w2): the same loader fills it from a per-tensor scale (one value, spread over the rows it covers)
or a per-channel one (one per row), slicing gate/up rows over TP like the weight's rows; w2's rows
(hidden) are never split, so its scales are whole on every rank.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch
from torch import nn

from shardserve.distributed.comm import dp_gather_tokens, dp_reduce_scatter_tokens, tensor_model_parallel_all_reduce
from shardserve.distributed.parallel_state import (
    get_dp_group,
    get_ep_group,
    get_tensor_model_parallel_world_size,
    get_tp_group,
)
from shardserve.kernels.cpu import moe_route
from shardserve.kernels.cpu.decoder_stack import StackMoe
from shardserve.kernels.moe import reference, torch_moe
from shardserve.kernels.moe.int4_experts import Int4Experts
from shardserve.layers.linear import ReplicatedLinear, default_weight_loader, quant_method_for


def _expert_load_on() -> bool:
    return os.environ.get("SHARDSERVE_EXPERT_LOAD") == "1"


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        valid = [d for d in range(1, numerator + 1) if numerator % d == 0]
        raise ValueError(f"{what}={numerator} is not divisible by {denominator}; valid sizes: {valid}")
    return numerator // denominator


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.route_topk's picks and weights: one Triton kernel on CUDA (kernels/moe/triton_route.py),
    torch elsewhere."""
    if router_logits.is_cuda:
        from shardserve.kernels.moe import triton_route
        if triton_route.handles(router_logits, top_k):
            return triton_route.route_topk(router_logits, top_k, renormalize)
    return reference.route_topk(router_logits, top_k, renormalize)


def experts_matmul(hidden: torch.Tensor, w13: torch.Tensor | Int4Experts, w2: torch.Tensor | Int4Experts,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                   w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped expert matmuls: Triton's fused kernels on CUDA (float / FP8 experts, or INT4 ones),
    torch grouped by expert elsewhere. w13_scale / w2_scale: per-row scales of FP8 experts (None: the
    weights are plain floats)."""
    if hidden.is_cuda and isinstance(w13, Int4Experts):
        from shardserve.kernels.moe import triton_moe_int4
        if triton_moe_int4.handles(hidden, w13):
            return triton_moe_int4.fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    elif hidden.is_cuda:
        from shardserve.kernels.moe import triton_moe
        if triton_moe.handles(hidden, w13, w13_scale):
            return triton_moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                                        w2_scale=w2_scale)
    return torch_moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


class MoEMethod(ABC):
    """How the experts of one weight format are stored, loaded and run; the quantization room
    implements one per format it supports for experts. Unquantized experts have none."""

    @abstractmethod
    def create_weights(self, layer: "FusedMoE") -> None:
        """Register `w13_weight`, `w2_weight` and any scales (layer.register_expert_param)."""

    def process_after_loading(self, layer: "FusedMoE") -> None:
        """Convert the loaded parameters to the form `apply` runs on (once, after loading)."""

    @abstractmethod
    def apply(self, layer: "FusedMoE", hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the picked experts' outputs (ids already local, -1 elsewhere)."""

    def stack_experts(self, layer: "FusedMoE") -> StackMoe | None:
        """The experts as the native decoder stack runs them on fp32 CPU rows, one kernel call for
        every pick (kernels/cpu/decoder_stack.py; router and routing left to the caller), with
        `apply`'s bits; None where `apply` is not that call."""
        return None


class FusedMoE(nn.Module):
    # The native CPU kernels may pack these per expert (cpu_ops.pack_weights; kernels/moe/torch_moe.py).
    packed_expert_weights = ("w13_weight", "w2_weight")

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, prefix: str = "mlp.experts") -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.prefix, self.hidden_size = prefix, hidden_size   # prefix: the layer's name, for errors
        ep, tp = get_ep_group(), get_tp_group()
        if ep.world_size > 1:   # whole experts per rank
            self.num_local_experts = _divide(num_experts, ep.world_size, "num_experts (expert parallel size)")
            self.expert_start = ep.rank * self.num_local_experts
            self.inter_shards, self.inter_rank = 1, 0
        else:                   # every expert, intermediate dimension split over TP
            self.num_local_experts, self.expert_start = num_experts, 0
            self.inter_shards, self.inter_rank = tp.world_size, tp.rank
        inter = _divide(intermediate_size, self.inter_shards, "moe_intermediate_size (tensor parallel size)")
        self.intermediate_size = inter
        self.quant_method: MoEMethod | None = quant_method_for(self)
        self._create_weights()
        # Global expert id -> local index, -1 where another rank holds it (None: every expert is here).
        expert_map = None
        if ep.world_size > 1:
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.expert_start:self.expert_start + self.num_local_experts] = torch.arange(
                self.num_local_experts, dtype=torch.int32)
        self.register_buffer("expert_map", expert_map, persistent=False)
        # Tokens routed to each expert since the last report (expert_load_report), for debugging
        # imbalance; counted on the device without a host sync, so CUDA graphs replay it too.
        load = torch.zeros(num_experts, dtype=torch.int64) if _expert_load_on() else None
        self.register_buffer("load", load, persistent=False)

    def _create_weights(self) -> None:
        if self.quant_method is None:
            inter, hidden = self.intermediate_size, self.hidden_size
            self.register_expert_param("w13_weight", torch.empty(self.num_local_experts, 2 * inter, hidden))
            self.register_expert_param("w2_weight", torch.empty(self.num_local_experts, hidden, inter))
        else:
            self.quant_method.create_weights(self)

    def requantize(self, method: MoEMethod | None) -> None:
        """The experts in another format, before any weight loads: the scheme their checkpoint stores
        them in where it is not the one the model was built in (models/loader.place_schemes); None:
        unquantized. The format's tensors go (and what its method set on the layer); the expert map
        and load counts stay. The new tensors go where the old ones are (the CPU for an offloaded
        layer: layers/cpu_offload.py)."""
        device = next(p.device for p in self.parameters())
        for name in list(self._parameters):
            del self._parameters[name]
        for name in [n for n in self._buffers if n not in ("expert_map", "load")]:
            del self._buffers[name]
        self.__dict__.pop("packed_expert_weights", None)   # (INT4 experts' "nothing to repack")
        self.quant_method = method
        with torch.device(device):
            self._create_weights()

    def register_expert_param(self, name: str, data: torch.Tensor, expert_scale: bool = False) -> nn.Parameter:
        """A stacked per-expert parameter filled through weight_loader. expert_scale: one value per
        output row of each expert (the module docstring), kept in fp32 by the loader."""
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader, param.expert_scale, param.full_precision = self.weight_loader, expert_scale, expert_scale
        self.register_parameter(name, param)
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int | None, str]) -> None:
        expert, kind = shard_id
        if expert is None:   # all experts stacked in one tensor
            for local in range(self.num_local_experts):
                self._load_expert(param, loaded[self.expert_start + local], local, kind)
        elif self.expert_start <= expert < self.expert_start + self.num_local_experts:
            self._load_expert(param, loaded, expert - self.expert_start, kind)

    def _full_rows(self, kind: str) -> int:
        """Output rows of one expert's checkpoint tensor of this kind (before any TP split)."""
        full_inter = self.intermediate_size * self.inter_shards
        return {"gate_up": 2 * full_inter, "gate": full_inter, "up": full_inter}.get(kind, self.hidden_size)

    def _load_expert(self, param: nn.Parameter, loaded: torch.Tensor, local: int, kind: str) -> None:
        inter, rank = self.intermediate_size, self.inter_rank
        if getattr(param, "expert_scale", False):
            # Per-tensor ([], [1]) or per-channel ([rows], [rows, 1]) scales: one value per output row.
            loaded = loaded.reshape(-1)
            rows = self._full_rows(kind)
            if loaded.numel() == 1:
                loaded = loaded.expand(rows)
            elif loaded.numel() != rows:
                raise ValueError(f"{self.prefix}: an expert's {kind} scale has {loaded.numel()} values; expected 1 "
                                 f"(per tensor) or {rows} (per output channel)")
            if kind == "down":   # w2's rows are the hidden size, never split
                default_weight_loader(param.data[local], loaded)
                return
        if kind == "gate_up":   # HF's fused [2 * intermediate, hidden], gate first
            half = loaded.shape[0] // 2
            self._load_expert(param, loaded[:half], local, "gate")
            self._load_expert(param, loaded[half:], local, "up")
        elif kind in ("gate", "up"):
            offset = 0 if kind == "gate" else inter
            default_weight_loader(param.data[local].narrow(0, offset, inter), loaded.narrow(0, rank * inter, inter))
        elif kind == "down":   # its inputs in the parameter's own units (packed FP4 bytes, scale groups)
            cols = param.shape[-1]
            default_weight_loader(param.data[local], loaded.narrow(1, rank * cols, cols))
        else:
            raise ValueError(f"unknown expert weight kind {kind!r}")

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> this rank's partial sum [T, H] of the picked experts' outputs."""
        topk_weights, topk_ids = route(router_logits, self.top_k, self.renormalize)
        if self.load is not None:
            ids = topk_ids.reshape(-1).long()
            self.load.scatter_add_(0, ids, torch.ones_like(ids))
        if self.expert_map is not None:
            topk_ids = self.expert_map[topk_ids.long()]
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden, topk_weights, topk_ids)
        return experts_matmul(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router + experts, in place of a dense MLP (`gate`, `experts` as HF names them)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, prefix: str = "mlp") -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                prefix=f"{prefix}.experts")
        self.tp_size = get_tensor_model_parallel_world_size()
        self.spans_replicas = get_dp_group().world_size > 1

    @property
    def supports_partial_sum(self) -> bool:
        return self.tp_size > 1

    def stack_moe(self) -> StackMoe | str:
        """This block as the native decoder stack runs it (kernels/cpu/decoder_stack.py: the router,
        the routing in C with route_topk's bits, the experts' one kernel call), or why it cannot: the
        experts split over ranks, expert-load counting, a router bias, experts other than one call."""
        experts = self.experts
        if self.tp_size > 1 or self.spans_replicas or experts.expert_map is not None:
            return "experts split over ranks"
        if experts.load is not None:
            return "expert-load counting"
        router = self.gate.stack_linear()
        if router is None or self.gate.bias is not None:
            return "a router that is not one native kernel without bias"
        method = experts.quant_method
        stack = method.stack_experts(experts) if method is not None else None
        if stack is None:
            return "experts other than GGUF blocks in one kernel call"
        if not moe_route.matches_torch(experts.num_experts, experts.top_k, experts.renormalize):
            return "routing in C without torch's bits here"
        stack.router, stack.experts, stack.top_k = router, experts.num_experts, experts.top_k
        stack.renormalize = int(experts.renormalize)
        return stack

    def forward(self, x: torch.Tensor, partial_sum: bool = False) -> torch.Tensor:
        """partial_sum: leave the output as this rank's partial sum for the next norm (as GatedMLP)."""
        if self.spans_replicas:   # this rank's experts serve every replica's tokens
            tokens, counts = dp_gather_tokens(x)
            out = self.experts(tokens, self.gate(tokens)) if tokens.shape[0] else tokens
            out = dp_reduce_scatter_tokens(out, counts)
        else:
            out = self.experts(x, self.gate(x))
        if partial_sum or self.tp_size == 1:
            return out
        return tensor_model_parallel_all_reduce(out)


def expert_load_report(model: nn.Module) -> str | None:
    """One line on how evenly the last steps spread tokens over each MoE layer's experts (with
    SHARDSERVE_EXPERT_LOAD=1; None otherwise, or before any token): per layer the busiest expert's
    count over the mean, and the counts of the most imbalanced layer. Resets the counts."""
    if not _expert_load_on():   # checked first: the model runner asks every step
        return None
    layers = [(name, m.load) for name, m in model.named_modules() if isinstance(m, FusedMoE) and m.load is not None]
    if not layers:
        return None
    counts = torch.stack([load for _, load in layers]).cpu()
    for _, load in layers:
        load.zero_()
    if counts.sum() == 0:
        return None
    ratio = counts.max(dim=1).values.float() / counts.float().mean(dim=1).clamp_min(1e-9)
    worst = int(ratio.argmax())
    return (f"expert load (busiest expert / mean, per MoE layer): {' '.join(f'{r:.2f}' for r in ratio.tolist())}; "
            f"{layers[worst][0]} tokens per expert: {counts[worst].tolist()}")
