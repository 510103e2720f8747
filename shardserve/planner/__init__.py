"""`shardserve plan`: what fits where and how fast it will decode (see docs/planner.md)."""
from __future__ import annotations

from typing import Any


def plan_from_options(model: str, gpu: str | None = None, gpu_memory: str | int | None = None,
                      gpus_per_node: int = 8, nodes: int = 1, interconnect: list[str] | None = None,
                      dtype: str = "auto", kv_cache_dtype: str = "auto", max_model_len: int | None = None,
                      concurrency: int = 1, gpu_memory_utilization: float = 0.9,
                      profile: str | None = None) -> dict[str, Any]:
    """The `plan` command's options (flag names as keyword arguments) -> the plan dict."""
    from shardserve.config import parse_size
    from shardserve.planner.catalog import resolve_model
    from shardserve.planner.cost import Cluster
    from shardserve.planner.hardware import apply_profile, load_profile, pick_gpu, pick_links
    from shardserve.planner.plan import PlanInputs, make_plan
    if gpus_per_node < 1 or nodes < 1:
        raise ValueError("--gpus-per-node and --nodes must be at least 1")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization {gpu_memory_utilization} must be in (0, 1]")
    device = pick_gpu(gpu, parse_size(gpu_memory) if gpu_memory is not None else None)
    intra, inter = pick_links(interconnect or [], device)
    notes: list[str] = []
    if profile:
        device, intra, inter, notes = apply_profile(load_profile(profile), device, intra, inter)
    name, config, source = resolve_model(model)
    cluster = Cluster(device, gpus_per_node, nodes, intra, inter, gpu_memory_utilization)
    return make_plan(PlanInputs(name, config, cluster, source, dtype, kv_cache_dtype, max_model_len, concurrency,
                                notes))


def predict_layout(model: str, gpu: str = "h100-80gb", tp: int = 1, pp: int = 1, dp: int = 1,
                   expert_parallel: bool = False, batch: int = 1, context: int = 1, dtype: str = "auto",
                   kv_cache_dtype: str = "auto", interconnect: list[str] | None = None,
                   gpu_memory_utilization: float = 0.9, profile: str | None = None) -> dict[str, Any]:
    """One layout's prediction, without the search: what `plan` computes for its row.

    `batch` requests per replica, each `context` tokens deep when the step runs (the KV it reads);
    with expert_parallel and dp > 1 the experts see all dp x batch tokens. Returns tp, pp, dp, ep,
    weight_bytes_per_rank (the fullest rank), kv_tokens_per_replica, decode_ms (one decode step =
    ms per token of each request) and its breakdown (hbm_ms, comm_ms, handoff_ms, total_ms).
    E.g. `predict_layout("qwen3-30b-a3b")`: one H100, bf16, batch 1."""
    from shardserve.planner.catalog import resolve_model
    from shardserve.planner.cost import Cluster, evaluate
    from shardserve.planner.hardware import apply_profile, load_profile, pick_gpu, pick_links
    from shardserve.planner.plan import PlanInputs, layout_problem, model_shape, resolve_dtypes
    device = pick_gpu(gpu, None)
    intra, inter = pick_links(interconnect or [], device)
    if profile:
        device, intra, inter, _ = apply_profile(load_profile(profile), device, intra, inter)
    name, config, source = resolve_model(model)
    cluster = Cluster(device, tp * pp * dp, 1, intra, inter, gpu_memory_utilization)
    weights, kv = resolve_dtypes(PlanInputs(name, config, cluster, dtype=dtype, kv_cache_dtype=kv_cache_dtype))
    shape = model_shape(config, source, weights)
    problem = layout_problem(shape, tp, pp, dp, expert_parallel)
    if problem:
        raise ValueError(problem)
    cost = evaluate(shape, cluster, tp, pp, weights, kv, context, batch, expert_parallel)
    return {"tp": tp, "pp": pp, "dp": dp, "ep": cost.ep, "dtype": weights, "kv_cache_dtype": kv,
            "weight_bytes_per_rank": cost.weight_bytes_per_rank, "kv_tokens_per_replica": cost.kv_tokens,
            "decode_ms": cost.decode_ms, "breakdown": cost.breakdown}
