"""A worker owns one device: it sets the device up and serves the executor's RPCs by delegating
to its ModelRunner. Every executor (in-process today, one process per device later) drives the
same methods through `collective_rpc`."""
from __future__ import annotations

import torch

from shardserve.config import EngineConfig
from shardserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shardserve.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset(),
                 show_progress: bool = True) -> None:
        self.config = config
        if config.device.type == "cuda":
            torch.cuda.set_device(config.device)
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config, eos_token_ids, show_progress)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def kv_bytes_per_block(self) -> int:
        return self.model_runner.kv_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(sched)
