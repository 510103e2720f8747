"""A worker owns one device: it joins the process groups, sets the device up and serves the
executor's RPCs by delegating to its ModelRunner. Every executor (in-process, one process per
device, Ray actors) drives the same methods through `collective_rpc`."""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from shardserve.config import EngineConfig
from shardserve.distributed.parallel_state import set_pp_partition
from shardserve.distributed.setup import destroy_distributed, init_distributed
from shardserve.layers.moe import FusedMoE
from shardserve.worker.model_runner import ModelRunner, PendingOutput
from shardserve.worker.profiler import StepProfiler
from shardserve.worker.step_io import ModelRunnerOutput, SchedulerOutput


class Worker:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset(),
                 show_progress: bool = True, rank: int = 0, local_rank: int = 0,
                 init_method: str | None = None) -> None:
        parallel_config = config.parallel_config
        if config.device.type == "cuda":
            config = replace(config, device=torch.device("cuda", local_rank))
            torch.cuda.set_device(config.device)
        self.config = config
        self.rank = rank
        spans = parallel_config.experts_span_replicas
        if parallel_config.world_size > 1 or spans:
            set_pp_partition(parallel_config.pp_layer_partition)
            init_distributed(rank, parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size,
                             init_method, config.device, parallel_config.distributed_timeout_s,
                             fast_all_reduce=not parallel_config.disable_custom_all_reduce,
                             enable_expert_parallel=parallel_config.enable_expert_parallel,
                             dp_size=parallel_config.data_parallel_size if spans else 1,
                             dp_rank=parallel_config.data_parallel_rank)
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config, eos_token_ids, show_progress)
        self.profiler = StepProfiler(rank, config.device)

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

    def launch(self, sched: SchedulerOutput) -> PendingOutput:
        """execute_model without waiting for the device; the result's get() does."""
        return self.model_runner.launch(sched)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """This rank's parameter shapes (tests check that sharded matrices really are 1/TP)."""
        # A weight packed for the native CPU kernel reports its logical shape.
        return {n: getattr(p, "logical_shape", None) or ((p.out_features, p.shape[1]) if hasattr(p, "out_features")
                                                         else tuple(p.shape))
                for n, p in self.model_runner.model.named_parameters()}

    def weight_bytes(self, experts_only: bool = False) -> int:
        """Bytes of this rank's parameters as held (each tensor once: "Model loading took ..."); with
        experts_only, those of its routed experts (the FusedMoE layers)."""
        model = self.model_runner.model
        modules = [m for m in model.modules() if isinstance(m, FusedMoE)] if experts_only else [model]
        return sum({p.data_ptr(): p.numel() * p.element_size() for m in modules for p in m.parameters()}.values())

    def cpu_offload_bytes(self) -> int:
        """Bytes of this rank's weights streamed from pinned CPU memory (--cpu-offload-gb)."""
        offload = getattr(self.model_runner.model, "cpu_offload", None)
        return offload.offloaded_bytes if offload is not None else 0

    def profile_decode_graph(self, batch_size: int, context: int = 256) -> dict:
        """The decode graph for batch_size replayed alone: its time and kernels (worker/graph_profile.py)."""
        from shardserve.worker.graph_profile import profile_decode_graph
        graphs = self.model_runner.graphs
        return profile_decode_graph(graphs.decode if graphs is not None else None, batch_size, context)

    def start_profile(self, directory: str) -> None:
        self.profiler.start(directory)

    def stop_profile(self) -> str:
        """Ends the trace started by start_profile; returns the file it was written to."""
        return self.profiler.stop()

    def environment(self, names: list[str]) -> dict[str, str | None]:
        """What this worker's process sees for the given variables (e.g. NCCL_* on every node)."""
        return {n: os.environ.get(n) for n in names}

    def shutdown(self) -> None:
        destroy_distributed()
