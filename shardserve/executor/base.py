"""The executor interface: how the engine reaches its workers, wherever they run."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from shardserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call `method` on every worker; returns one result per worker, in rank order."""

    def determine_num_blocks(self) -> int:
        # Every rank must fit the pool, so the smallest answer wins.
        return min(self.collective_rpc("determine_num_blocks"))

    def kv_bytes_per_block(self) -> int:
        return self.collective_rpc("kv_bytes_per_block")[0]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    # A step is submitted and collected separately: several batches may be in flight (async
    # scheduling, pipeline stages, data-parallel replicas); results come back in submission order.
    @abstractmethod
    def submit_execute(self, sched: SchedulerOutput) -> None:
        """Hand one step to every worker without waiting for its result."""

    @abstractmethod
    def collect_execute(self) -> ModelRunnerOutput:
        """The oldest submitted step's result (from the rank that samples)."""

    def check_health(self) -> None:
        """Raise if a worker is known to be gone (called while idle; steps detect it themselves)."""

    def shutdown(self) -> None:
        pass


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
        from shardserve.executor.ray import RayExecutor
        return RayExecutor(config, eos_token_ids, show_progress, replica=replica)
    raise ValueError(f"executor backend {backend!r} is not available")
