"""Which executor runs the engine's workers: above the implementations, so none of them imports it."""
from __future__ import annotations

from shardserve.executor.base import Executor
from shardserve.utils import require_extra

RAY_NEEDS = "--distributed-executor-backend ray needs"


def make_executor(config, eos_token_ids: frozenset[int], show_progress: bool, replica: int = 0) -> Executor:
    """`replica` is the data-parallel index: replica r uses devices r * world_size onwards."""
    backend = config.parallel_config.executor_backend
    if backend == "uni" and config.parallel_config.data_parallel_size > 1:
        backend = "mp"   # replicas must run in their own processes to run at the same time
    if backend == "uni":
        from shardserve.executor.uniproc import UniProcExecutor
        return UniProcExecutor(config, eos_token_ids, show_progress)
    if backend == "mp":
        from shardserve.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor(config, eos_token_ids, show_progress, replica=replica)
    if backend == "ray":
        require_extra(RAY_NEEDS, "ray", "ray")   # one line before any worker starts, not an ImportError
        from shardserve.executor.ray import RayExecutor
        return RayExecutor(config, eos_token_ids, show_progress, replica=replica)
    raise ValueError(f"executor backend {backend!r} is not available")
