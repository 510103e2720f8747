"""Workers as Ray actors, placed with a placement group on an existing Ray cluster (as vLLM does).

`ray.init(address="auto")` joins the cluster this process runs in (or RAY_ADDRESS); one bundle per
rank ({"GPU": 1} on GPUs, {"CPU": 1} otherwise) is reserved, ranks are ordered by node so that a
tensor-parallel group stays inside one node, and torch.distributed meets at a store that rank 0's
actor hosts. An actor that dies turns the next call into a WorkerDiedError naming its rank.
"""
from __future__ import annotations

from collections import deque
from typing import Any

from shardserve.config import EngineConfig
from shardserve.executor.base import Executor, WorkerDiedError
from shardserve.utils import require_extra


class _RayWorker:
    """The actor body: builds a Worker once told its rank, then runs whatever the engine asks."""

    def __init__(self) -> None:
        self.worker = None
        self.store = None   # rank 0 only: the rendezvous store, kept for the actor's life

    def node_ip(self) -> str:
        import ray
        return ray.util.get_node_ip_address()

    def host_store(self, world: int, host: str, timeout_s: float) -> str:
        """Rank 0's actor hosts the ranks' rendezvous store (parallel_state.host_store) for its life."""
        from shardserve.distributed.parallel_state import host_store
        self.store, init_method = host_store(world, timeout_s, host)
        return init_method

    def start(self, config: EngineConfig, rank: int, local_rank: int, init_method: str,
              eos_token_ids: frozenset[int], show_progress: bool, threads: int) -> None:
        import torch

        from shardserve.worker.worker import Worker
        torch.set_num_threads(threads)
        self.worker = Worker(config, eos_token_ids, show_progress, rank=rank, local_rank=local_rank,
                             init_method=init_method)

    def call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset(),
                 show_progress: bool = True, replica: int = 0) -> None:
        require_extra("distributed_executor_backend='ray' needs", "ray", "ray")
        import ray
        self._ray = ray
        self._in_flight: deque[list] = deque()
        parallel_config = config.parallel_config
        self.world_size = parallel_config.world_size
        self.output_rank = (parallel_config.pipeline_parallel_size - 1) * parallel_config.tensor_parallel_size
        if not ray.is_initialized():
            try:
                ray.init(address="auto", log_to_driver=False)
            except ConnectionError as e:   # no cluster: one line, not Ray's traceback
                raise ValueError("--distributed-executor-backend ray joins a running Ray cluster and found none: "
                                 "start one (ray start --head) or set RAY_ADDRESS") from e
        gpu = config.device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.pg, self.actors = None, []
        try:
            self._start(config, eos_token_ids, show_progress, gpu, bundle)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig, eos_token_ids, show_progress: bool, gpu: bool, bundle: dict) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        parallel_config = config.parallel_config
        self.pg = placement_group([bundle] * self.world_size, strategy="PACK")
        ray.get(self.pg.ready(), timeout=parallel_config.distributed_timeout_s)
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_RayWorker)
        actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=i)).remote() for i in range(self.world_size)]
        # Order ranks by node (stable), so TP groups of consecutive ranks share a node.
        ips = ray.get([a.node_ip.remote() for a in actors])
        order = sorted(range(self.world_size), key=lambda i: ips[i])
        self.actors = [actors[i] for i in order]
        ips = [ips[i] for i in order]
        init_method = ray.get(self.actors[0].host_store.remote(self.world_size, ips[0],
                                                               parallel_config.distributed_timeout_s))
        # Ray gives each actor exactly one GPU through CUDA_VISIBLE_DEVICES: it is always cuda:0.
        self._get([a.start.remote(config, r, 0, init_method, eos_token_ids, show_progress and r == self.output_rank, 1)
                   for r, a in enumerate(self.actors)], parallel_config.distributed_timeout_s)
        self.collective_rpc("load_model")

    def _get(self, refs: list, timeout_s: float | None = None) -> list[Any]:
        ray = self._ray
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.RayActorError as e:
            dead = next((r for r, ref in enumerate(refs) if _failed(ray, ref)), None)
            self.shutdown()
            raise WorkerDiedError(f"worker rank {dead} (Ray actor) died: {e}") from e

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        if not self.actors:
            raise RuntimeError("the engine's workers are stopped (after a failure or shutdown)")
        return self._get([a.call.remote(method, args, kwargs or {}) for a in self.actors])

    def submit_execute(self, sched) -> None:
        # Each actor runs its calls in order, so batches queue up behind one another.
        self._in_flight.append([a.call.remote("execute_model", (sched,), {}) for a in self.actors])

    def collect_execute(self):
        return self._get(self._in_flight.popleft())[self.output_rank]

    def shutdown(self) -> None:
        ray = self._ray
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        self.actors = []
        if getattr(self, "pg", None) is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None


def _failed(ray, ref) -> bool:
    try:
        ray.get(ref, timeout=0)
        return False
    except ray.exceptions.RayActorError:
        return True
    except Exception:
        return False
