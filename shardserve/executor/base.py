"""The executor interface: how the engine reaches its workers, wherever they run."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from shardserve.worker.step_io import ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker process (or Ray actor) is gone; the message names its rank."""


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
