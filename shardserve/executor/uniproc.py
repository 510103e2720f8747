"""One worker in the engine's own process: the single-device executor."""
from __future__ import annotations

from collections import deque
from typing import Any

from shardserve.config import EngineConfig
from shardserve.executor.base import Executor
from shardserve.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset(),
                 show_progress: bool = True) -> None:
        self.worker = Worker(config, eos_token_ids, show_progress)
        self.worker.load_model()
        self._launched: deque = deque()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    # Steps are launched and collected separately, so with async scheduling the engine prepares the
    # next step while the device runs this one.
    def submit_execute(self, sched) -> None:
        self._launched.append(self.worker.launch(sched))

    def collect_execute(self):
        return self._launched.popleft().get()
