"""The executor interface: how the engine reaches its workers, wherever they run."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
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

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (sched,))[0]

    # Split form: several batches may be in flight (pipeline stages, data-parallel replicas);
    # results come back in submission order. In-process executors simply run at submit time.
    def submit_execute(self, sched: SchedulerOutput) -> None:
        if not hasattr(self, "_pending"):
            self._pending: deque[ModelRunnerOutput] = deque()
        self._pending.append(self.execute_model(sched))

    def collect_execute(self) -> ModelRunnerOutput:
        return self._pending.popleft()

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
