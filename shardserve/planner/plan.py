"""`shardserve plan`: every (TP, PP, DP) layout of a model on a cluster (MoE models: each also with
expert parallelism), which ones fit and why not, a recommendation, single-GPU baselines, and what
would make a model fit that does not.

The result is a plain dict (what `--json` prints); `report.py` turns it into tables."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from shardserve.planner.catalog import (
    checkpoint_expert_bytes,
    gguf_embedding_bytes,
    gguf_expert_bytes,
    gguf_linear_bytes,
)
from shardserve.planner.cost import Cluster, LayoutCost, activation_reserve, ep_size, evaluate, offload_decode_ms
from shardserve.planner.hardware import GPUS, LINKS
from shardserve.planner.memory import WEIGHT_BYTES, ModelShape, config_dtype, norm_dtype

NEAR_BEST = 1.05      # layouts within 5% of the fastest count as equally fast: then fewer GPUs per replica win
MAX_SEARCH_GPUS = 4096
KV_BLOCK = 16         # the smallest useful KV cache: one block


@dataclass
class PlanInputs:
    name: str
    config: dict[str, Any]
    cluster: Cluster
    source: dict[str, Any] = field(default_factory=dict)
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    concurrency: int = 1
    profile_notes: list[str] = field(default_factory=list)


def resolve_dtypes(inputs: PlanInputs) -> tuple[str, str]:
    dtype = config_dtype(inputs.config) if inputs.dtype == "auto" else norm_dtype(inputs.dtype)
    if dtype not in WEIGHT_BYTES:
        raise ValueError(f"--dtype {inputs.dtype!r}: choose one of auto, {', '.join(WEIGHT_BYTES)}")
    kv = inputs.kv_cache_dtype
    if kv == "auto":     # the KV cache is written in the activation dtype
        kv = dtype if dtype in ("fp32", "fp16") else "bf16"
    kv = norm_dtype(kv)
    if kv not in ("fp32", "bf16", "fp16", "fp8"):
        raise ValueError(f"--kv-cache-dtype {inputs.kv_cache_dtype!r}: choose auto, bf16, fp16, fp32 or fp8")
    return dtype, kv


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problem(shape: ModelShape, tp: int, pp: int, dp: int = 1, expert_parallel: bool = False,
                   nodes: int = 1) -> str | None:
    if pp > shape.layers:
        return f"PP={pp} exceeds the {shape.layers} layers"
    if not expert_parallel:
        return shape.tp_problem(tp)
    if dp > 1 and pp > 1:    # the engine's rules (config.py): EP over replicas runs PP=1, on one node
        return f"EP over DP x TP ranks needs PP=1 (PP={pp})"
    if dp > 1 and nodes > 1:
        return "EP over DP x TP ranks runs on one node"
    return shape.tp_problem(tp, ep_size(tp, dp, True))


def layout_name(row: dict[str, Any]) -> str:
    """"TP=2 PP=1", with " EP=8" for an expert-parallel layout."""
    return f"TP={row['tp']} PP={row['pp']}" + (f" EP={row['ep']}" if row.get("expert_parallel") else "")


def _variants(shape: ModelShape, tp: int, dp: int) -> tuple[bool, ...]:
    """Experts sliced over TP, and for MoE models also whole over an EP group of more than one rank."""
    return (False, True) if any(shape.moe_layers) and ep_size(tp, dp, True) > 1 else (False,)


def fit_status(cost: LayoutCost, need_tokens: int) -> tuple[str, str | None]:
    """("fits" | "kv" | "weights", why not)."""
    if cost.free_bytes_per_rank <= 0:
        return "weights", (f"weights {cost.weight_bytes_per_rank / 2**30:.1f} GiB per rank leave no room "
                           f"(short by {-cost.free_bytes_per_rank / 2**30:.1f} GiB)")
    if cost.kv_tokens < need_tokens:
        return "kv", f"KV cache holds {cost.kv_tokens:,} tokens, {need_tokens:,} needed"
    return "fits", None


def min_gpus(shape: ModelShape, like: Cluster, dtype: str, kv: str, need_tokens: int) -> dict[str, Any] | None:
    """The fewest GPUs of this kind (nodes of `gpus_per_node`) one replica needs: TP inside a node first."""
    gpn = like.gpus_per_node
    counts = list(range(1, gpn + 1)) + [gpn * k for k in range(2, MAX_SEARCH_GPUS // gpn + 1)]
    for n in counts:
        cluster = replace(like, gpus_per_node=min(n, gpn), nodes=max(1, n // gpn))
        options = []
        for tp in _divisors(n):
            # EP only where slicing the experts over TP is not valid: it holds the same bytes per rank.
            ep = any(shape.moe_layers) and layout_problem(shape, tp, n // tp) is not None
            if layout_problem(shape, tp, n // tp, expert_parallel=ep):
                continue
            cost = evaluate(shape, cluster, tp, n // tp, dtype, kv, 1, 1, expert_parallel=ep)
            if fit_status(cost, need_tokens)[0] == "fits":
                options.append((cost.tp_crosses_nodes, n // tp, tp, ep))
        if options:
            crosses, pp, tp, ep = min(options)
            return {"gpus": n, "nodes": max(1, n // gpn), "tp": tp, "pp": pp,
                    **({"expert_parallel": True, "ep": tp} if ep else {})}
    return None


def _layouts(shape: ModelShape, inputs: PlanInputs, dtype: str, kv: str, context: int
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cluster, total = inputs.cluster, inputs.cluster.total_gpus
    rows, invalid = [], []
    moe = any(shape.moe_layers)
    for tp in _divisors(total):
        for pp in _divisors(total // tp):
            dp = total // (tp * pp)
            sliced = layout_problem(shape, tp, pp)
            for ep in _variants(shape, tp, dp):
                problem = layout_problem(shape, tp, pp, dp, ep, cluster.nodes)
                tag = {"expert_parallel": ep, "ep": ep_size(tp, dp, ep)} if moe else {}
                if problem:
                    if not ep or problem != sliced:    # a reason EP shares with the sliced layout is listed once
                        invalid.append({"tp": tp, "pp": pp, "dp": dp, **tag, "reason": problem})
                    continue
                rows.append(_row(shape, inputs, tp, pp, dp, ep, tag, dtype, kv, context))
    return rows, invalid


def _row(shape: ModelShape, inputs: PlanInputs, tp: int, pp: int, dp: int, ep: bool, tag: dict[str, Any],
         dtype: str, kv: str, context: int) -> dict[str, Any]:
    batch = math.ceil(inputs.concurrency / dp)
    cost = evaluate(shape, inputs.cluster, tp, pp, dtype, kv, context, batch, ep, inputs.concurrency)
    status, reason = fit_status(cost, batch * context)
    return {"tp": tp, "pp": pp, "dp": dp, **tag, "status": status, "fits": status == "fits", "reason": reason,
            "weight_bytes_per_rank": cost.weight_bytes_per_rank,
            "kv_bytes_free_per_rank": max(cost.free_bytes_per_rank, 0.0),
            "kv_tokens_per_replica": cost.kv_tokens,
            "max_concurrency": dp * (cost.kv_tokens // context),
            "tp_crosses_nodes": cost.tp_crosses_nodes, "pp_crosses_nodes": cost.pp_crosses_nodes,
            "decode_ms": cost.decode_ms, "breakdown": cost.breakdown, "batch_per_replica": batch}


def recommend(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Fits; TP inside a node when any such layout fits; the fastest, and among layouts within 5%
    of it the one with the fewest GPUs per replica (more replicas serve more users); on a tie,
    experts sliced over TP rather than expert parallel."""
    fits = [r for r in rows if r["fits"]]
    if any(not r["tp_crosses_nodes"] for r in fits):
        fits = [r for r in fits if not r["tp_crosses_nodes"]]
    if not fits:
        return None
    best = min(r["decode_ms"] for r in fits)
    near = [r for r in fits if r["decode_ms"] <= best * NEAR_BEST]
    return min(near, key=lambda r: (r["tp"] * r["pp"], r["decode_ms"], r.get("expert_parallel", False)))


def baselines(shape: ModelShape, inputs: PlanInputs, dtype: str, kv: str, context: int) -> dict[str, Any]:
    """One GPU of the chosen kind (offloading to CPU memory if it must), and the fastest single GPU
    of the built-in table that holds the model: when it beats the layouts, buy the bigger GPU."""
    c, batch = inputs.cluster, inputs.concurrency
    one = replace(c, gpus_per_node=1, nodes=1)
    cost = evaluate(shape, one, 1, 1, dtype, kv, context, batch)
    status, reason = fit_status(cost, batch * context)
    same: dict[str, Any] = {"gpu": c.gpu.name, "status": status, "reason": reason, "decode_ms": cost.decode_ms}
    if status == "weights":
        ms, offloaded = offload_decode_ms(shape, c.gpu, LINKS[c.gpu.host_link], dtype, kv, context, batch,
                                          c.gpu_memory_utilization)
        same.update(decode_ms=ms, offload_bytes=offloaded, host_link=c.gpu.host_link)
    best = None
    for gpu in GPUS.values():
        gpu = c.gpu if gpu.name == c.gpu.name else gpu      # keep measured numbers for the user's GPU
        g = evaluate(shape, replace(one, gpu=gpu), 1, 1, dtype, kv, context, batch)
        if fit_status(g, batch * context)[0] == "fits" and (best is None or g.decode_ms < best["decode_ms"]):
            best = {"gpu": gpu.name, "decode_ms": g.decode_ms}
    return {"same_gpu": same, "best_single_gpu": best}


def advice(shape: ModelShape, inputs: PlanInputs, rows: list[dict[str, Any]], dtype: str, kv: str,
           context: int) -> list[str]:
    """What would make it fit, with numbers: a shorter context, a smaller KV or weight dtype, more GPUs."""
    out = []
    c = inputs.cluster
    roomy = [r for r in rows if r["status"] != "weights"]
    if roomy:
        r = max(roomy, key=lambda r: r["kv_tokens_per_replica"])
        per_request = r["kv_tokens_per_replica"] // r["batch_per_replica"]
        out.append(f"shorter context: --max-model-len {per_request:,} fits with {layout_name(r)} "
                   f"({r['kv_tokens_per_replica']:,} KV tokens per replica)")
        if kv != "fp8":
            ratio = shape.kv_bytes_per_token_layer(kv) / shape.kv_bytes_per_token_layer("fp8")
            out.append(f"--kv-cache-dtype fp8 halves the KV bytes: about {int(per_request * ratio):,} tokens")
    total = shape.weight_bytes(dtype, 1, range(shape.layers), True, True)
    for smaller in ("fp8", "int4"):
        if WEIGHT_BYTES[smaller] >= WEIGHT_BYTES[dtype]:
            continue
        size = shape.weight_bytes(smaller, 1, range(shape.layers), True, True)
        here = recommend(_layouts(shape, inputs, smaller, kv, context)[0])
        if here:
            where = (f"fits these {c.total_gpus} x {c.gpu.name} with {layout_name(here)} "
                     f"({here['decode_ms']:.1f} ms/token)")
        else:
            need = min_gpus(shape, c, smaller, kv, context * inputs.concurrency)
            where = (f"needs {need['gpus']} x {c.gpu.name} ({layout_name(need)})" if need
                     else f"does not fit {MAX_SEARCH_GPUS} GPUs")
        out.append(f"--dtype {smaller}: weights {size / 1e9:,.1f} GB instead of {total / 1e9:,.1f} GB; {where}")
    need = min_gpus(shape, c, dtype, kv, context * inputs.concurrency)
    if need:
        out.append(f"more GPUs: {need['gpus']} x {c.gpu.name} ({need['nodes']} node(s) of "
                   f"{c.gpus_per_node}) hold it at {dtype} with {layout_name(need)}")
    return out


def model_shape(config: dict[str, Any], source: dict[str, Any], dtype: str) -> ModelShape:
    """The sizing view of a model served in `dtype`, with the bytes a GPU holds where they are not
    `dtype`'s: a GGUF file's blocks kept as they are, a checkpoint's experts stored apart."""
    linear, embed = gguf_linear_bytes(source, dtype), gguf_embedding_bytes(source, dtype)
    expert = gguf_expert_bytes(source, dtype) or checkpoint_expert_bytes(config, dtype)
    return ModelShape(config, *({dtype: b} if b is not None else None for b in (linear, embed, expert)))


def make_plan(inputs: PlanInputs) -> dict[str, Any]:
    dtype, kv = resolve_dtypes(inputs)
    shape = model_shape(inputs.config, inputs.source, dtype)
    context = inputs.max_model_len or shape.max_position_embeddings
    if context < 1 or inputs.concurrency < 1:
        raise ValueError("--max-model-len and --concurrency must be positive")
    c = inputs.cluster
    counts = shape.param_counts()
    rows, invalid = _layouts(shape, inputs, dtype, kv, context)
    rec = recommend(rows)
    weights = {d: shape.weight_bytes(d, 1, range(shape.layers), True, True) for d in ("bf16", "fp8", "int4")}
    weights[dtype] = shape.weight_bytes(dtype, 1, range(shape.layers), True, True)
    kv_token = shape.kv_bytes_per_token(kv)
    return {
        "model": {"name": inputs.name, **inputs.source,
                  "architecture": (inputs.config.get("architectures") or ["?"])[0],
                  "params_total": counts["total"], "params_active": counts["active"], "layers": shape.layers,
                  "hidden_size": shape.hidden, "attention_heads": shape.heads, "kv_heads": shape.kv_heads,
                  "head_dim": shape.head_dim, "experts": shape.experts, "experts_per_token": shape.top_k,
                  "mla": shape.mla, "max_position_embeddings": shape.max_position_embeddings},
        "settings": {"gpu": c.gpu.name, "gpu_memory_bytes": c.gpu.memory_bytes, "hbm_bandwidth": c.gpu.hbm_bandwidth,
                     "gpus_per_node": c.gpus_per_node, "nodes": c.nodes, "total_gpus": c.total_gpus,
                     "interconnect": {"intra_node": vars(c.intra), "inter_node": vars(c.inter)},
                     "dtype": dtype, "kv_cache_dtype": kv, "max_model_len": context,
                     "concurrency": inputs.concurrency, "gpu_memory_utilization": c.gpu_memory_utilization,
                     "activation_reserve_bytes_tp1": activation_reserve(shape, 1), "profile": inputs.profile_notes},
        "weights": {"bytes": weights[dtype], "bytes_by_dtype": weights},
        "kv_cache": {"bytes_per_token_per_layer": shape.kv_bytes_per_token_layer(kv), "bytes_per_token": kv_token,
                     "bytes_per_request": kv_token * context},
        "min_gpus": {"weights": min_gpus(shape, c, dtype, kv, KV_BLOCK),
                     "requests": min_gpus(shape, c, dtype, kv, context * inputs.concurrency)},
        "layouts": rows,
        "invalid_layouts": invalid,
        "recommended": rec,
        "baseline": baselines(shape, inputs, dtype, kv, context),
        "advice": [] if rec else advice(shape, inputs, rows, dtype, kv, context),
    }
