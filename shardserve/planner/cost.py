"""Memory and decode time of one (TP, PP, DP) layout, with MoE experts sliced over TP or split whole
over an expert-parallel group (EP): what each rank holds, how many KV tokens fit, and a roofline
estimate of one decode step.

Decode is memory-bound: a step reads every weight a rank holds (routed experts: the ones its tokens
picked) and the KV cache of every request in the batch, so its time is bytes / HBM bandwidth.
Tensor parallelism adds 2 all-reduces per layer (after attention and after the MLP) plus one for
the vocab-parallel embedding; pipeline stages run one after another for a given token, so stage
times add up and each stage boundary costs one hand-off of the hidden state and residual.
Expert parallelism over DP x TP ranks (DP > 1) makes the replicas step together: each MoE layer
gathers every replica's tokens over the DP group (a count, then the hidden states), runs the rank's
experts on all of them and reduce-scatters the outputs back (layers/moe.py, distributed/comm.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardserve.distributed.parallel_state import pp_layer_partition
from shardserve.planner.hardware import GPU, GiB, Link, allreduce_seconds, gather_seconds, p2p_seconds
from shardserve.planner.memory import ModelShape

ACT_BYTES = 2                 # activations and hand-offs stay 16-bit whatever the weight dtype
FIXED_OVERHEAD = 1 * GiB      # CUDA context, NCCL buffers, CUDA graphs, allocator slack (an estimate)
MAX_NUM_BATCHED_TOKENS = 2048  # the engine's default token budget: the activation peak it profiles
MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int
    nodes: int
    intra: Link               # GPU to GPU inside a node
    inter: Link               # between nodes
    gpu_memory_utilization: float = 0.9

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def node_of(self, gpu_index: int) -> int:
        return gpu_index // self.gpus_per_node


@dataclass
class LayoutCost:
    tp: int
    pp: int
    dp: int
    weight_bytes_per_rank: float = 0.0        # the fullest rank
    kv_tokens: int = 0                         # KV capacity of one replica, in tokens
    free_bytes_per_rank: float = 0.0           # for the KV cache, on the fullest rank
    ep: int = 1                                # expert-parallel group size (1: experts sliced over TP)
    tp_crosses_nodes: bool = False
    pp_crosses_nodes: bool = False
    decode_ms: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp


def ep_size(tp: int, dp: int, expert_parallel: bool) -> int:
    """The expert-parallel group: the stage's TP group, or every replica's TP group (DP x TP) with
    DP > 1 (distributed/parallel_state.py); 1 without expert parallelism."""
    return (tp * dp if dp > 1 else tp) if expert_parallel else 1


def activation_reserve(shape: ModelShape, tp: int, gathered: int = 1) -> float:
    """Peak activation memory of a forward pass over the token budget, per rank (vLLM profiles
    it; we estimate it): residual + normed hidden + attention in/out (4 x hidden) and the MLP's
    gate/up output (whole experts over EP get tokens x top-k / EP rows of full width: the same on
    average), plus fp32 logits for the sampled rows. `gathered` > 1: EP over that many replicas
    also holds their tokens gathered, the experts' output and the padded combine (3 x hidden each)."""
    mlp = 2 * (shape.top_k * shape.moe_intermediate if any(shape.moe_layers) else shape.intermediate) / tp
    exchange = 3 * gathered * shape.hidden if gathered > 1 else 0
    act = MAX_NUM_BATCHED_TOKENS * (4 * shape.hidden + mlp + exchange) * ACT_BYTES
    logits = MAX_NUM_SEQS * math.ceil(shape.vocab / tp) * 4
    return FIXED_OVERHEAD + act + logits


def stages(shape: ModelShape, pp: int) -> list[range]:
    sizes = pp_layer_partition(shape.layers, pp)   # the engine's own split: remainder to early stages
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


def evaluate(shape: ModelShape, cluster: Cluster, tp: int, pp: int, dtype: str, kv_dtype: str,
             context: int, batch: int, expert_parallel: bool = False, requests: int | None = None) -> LayoutCost:
    """Memory per rank and decode time per token for `batch` requests per replica, each `context`
    tokens deep. expert_parallel: experts whole over the EP group (ep_size); `requests` in flight over
    all replicas (default DP x batch) is what experts spanning the replicas see."""
    dp = cluster.total_gpus // (tp * pp)
    ep = ep_size(tp, dp, expert_parallel)
    spans = expert_parallel and dp > 1 and any(shape.moe_layers)
    seen = min(requests or dp * batch, dp * batch) if spans else batch   # tokens a rank's experts see
    cost = LayoutCost(tp, pp, dp, ep=ep)
    usable = (cluster.gpu.memory_bytes * cluster.gpu_memory_utilization
              - activation_reserve(shape, tp, dp if spans else 1))
    kv_layer = shape.kv_bytes_per_token_layer(kv_dtype, tp)
    parts = stages(shape, pp)
    tokens = []
    for s, layers in enumerate(parts):
        w = shape.weight_bytes(dtype, tp, layers, s == 0, s == pp - 1, ep=ep)
        cost.weight_bytes_per_rank = max(cost.weight_bytes_per_rank, w)
        free = usable - w
        tokens.append(max(int(free // (kv_layer * len(layers))), 0) if free > 0 else 0)
    cost.free_bytes_per_rank = usable - cost.weight_bytes_per_rank
    cost.kv_tokens = min(tokens)

    worst: dict[str, float] = {}
    for r in range(dp):                     # replicas sit on consecutive GPUs: rank = pp_rank * tp + tp_rank
        base = r * tp * pp
        hbm = comm = handoff = exchange = 0.0
        for s, layers in enumerate(parts):
            first_gpu = base + s * tp
            crosses = cluster.node_of(first_gpu) != cluster.node_of(first_gpu + tp - 1)
            cost.tp_crosses_nodes |= crosses
            link = cluster.inter if crosses else cluster.intra
            read = shape.weight_bytes(dtype, tp, layers, s == 0, s == pp - 1, batch=seen, ep=ep)
            read += batch * context * kv_layer * len(layers)
            hbm += read / cluster.gpu.hbm_bandwidth
            if tp > 1:
                n = 2 * len(layers) + (1 if s == 0 else 0)
                comm += n * allreduce_seconds(batch * shape.hidden * ACT_BYTES, tp, link)
                if s == pp - 1:             # logits all-gather: each rank sends its vocab slice
                    comm += link.latency_s + (tp - 1) / tp * batch * shape.vocab * ACT_BYTES / link.bandwidth
            if spans:                       # per MoE layer: gather counts, gather tokens, reduce-scatter outputs
                last_replica = (dp - 1) * tp * pp + s * tp
                dp_link = cluster.inter if cluster.node_of(s * tp) != cluster.node_of(last_replica) else cluster.intra
                tokens = dp * batch * shape.hidden * ACT_BYTES       # padded to the fullest replica
                per_layer = (gather_seconds(8 * dp, dp, dp_link) + 2 * gather_seconds(tokens, dp, dp_link))
                exchange += sum(shape.moe_layers[i] for i in layers) * per_layer
            if s < pp - 1:
                hop = cluster.node_of(first_gpu) != cluster.node_of(first_gpu + tp)
                cost.pp_crosses_nodes |= hop
                handoff += p2p_seconds(2 * batch * shape.hidden * ACT_BYTES, cluster.inter if hop else cluster.intra)
        comm += exchange
        total = hbm + comm + handoff
        if total * 1e3 > worst.get("total_ms", -1.0):
            worst = {"hbm_ms": hbm * 1e3, "comm_ms": comm * 1e3, "handoff_ms": handoff * 1e3, "total_ms": total * 1e3}
            if expert_parallel:             # the EP token exchange, included in comm_ms
                worst["ep_exchange_ms"] = exchange * 1e3
    cost.breakdown = worst
    cost.decode_ms = worst["total_ms"]
    return cost


def offload_decode_ms(shape: ModelShape, gpu: GPU, host: Link, dtype: str, kv_dtype: str, context: int,
                      batch: int, utilization: float) -> tuple[float, float]:
    """One GPU with the weights that do not fit streamed from CPU memory over PCIe every step.
    Returns (ms per token, bytes offloaded)."""
    layers = range(shape.layers)
    total = shape.weight_bytes(dtype, 1, layers, True, True)
    read = shape.weight_bytes(dtype, 1, layers, True, True, batch=batch)
    kv = batch * context * shape.kv_bytes_per_token(kv_dtype)
    room = gpu.memory_bytes * utilization - activation_reserve(shape, 1) - kv
    resident = min(max(room, 0.0), total)
    offloaded = total - resident
    frac = read / total                     # MoE: a step touches only part of the weights, wherever they live
    seconds = (resident * frac + kv) / gpu.hbm_bandwidth + offloaded * frac / host.bandwidth
    return seconds * 1e3, offloaded
