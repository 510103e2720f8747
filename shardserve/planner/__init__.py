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
