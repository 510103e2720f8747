"""Which engine serves: one LLMEngine, or a DataParallelEngine of replicas. Above both, so neither
imports the other."""
from __future__ import annotations

from shardserve.engine.args import EngineArgs
from shardserve.engine.dp_engine import DataParallelEngine
from shardserve.engine.engine import LLMEngine


def create_engine(args: EngineArgs, show_progress: bool = True) -> LLMEngine | DataParallelEngine:
    """An LLMEngine, or a DataParallelEngine of replicas when data_parallel_size > 1 (vLLM's
    LLMEngine.from_engine_args)."""
    config = args.create_engine_config()
    if config.parallel_config.data_parallel_size > 1:
        return DataParallelEngine(config, show_progress)
    return LLMEngine(config, show_progress)
