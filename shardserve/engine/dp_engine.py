"""Data parallelism: independent engine replicas behind one front end.

Each replica is a full LLMEngine (its own scheduler, KV pool and worker processes on its own
devices). A new request goes to the least loaded replica (running + waiting requests, ties to the
lowest index). A step submits every busy replica's batch first and only then collects, so replicas
compute at the same time.

With expert parallelism (`enable_expert_parallel`), the replicas' ranks form one process group
whose EP group spans every replica (distributed/parallel_state.init_groups): each MoE layer
exchanges tokens between replicas, so the replicas are built at the same time (their ranks meet at
start-up) and step together: while any has work, every replica runs one step, empty or not.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from shardserve.config import EngineConfig
from shardserve.distributed.parallel_state import host_store
from shardserve.engine.engine import EngineStats, LLMEngine, PromptType
from shardserve.outputs import RequestOutput
from shardserve.sampling_params import SamplingParams
from shardserve.spec_decode.stats import SpecDecodingStats
from shardserve.tokenizer.tokenizer import Tokenizer


class DataParallelEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        model_config = config.model_config
        self.tokenizer = (None if model_config.skip_tokenizer_init
                          else Tokenizer.from_path(model_config.tokenizer or model_config.model))
        self.config = config
        self.replicas: list[LLMEngine] = []
        parallel = config.parallel_config
        self.lockstep = parallel.experts_span_replicas
        self._store = None
        if self.lockstep:   # one rendezvous for every replica's ranks, alive as long as they run
            self._store, master = host_store(parallel.world_size * parallel.data_parallel_size,
                                             parallel.distributed_timeout_s)

        def build(r: int) -> LLMEngine:
            seeded = replace(config, model_config=replace(model_config, seed=model_config.seed + r))
            if self.lockstep:
                seeded = replace(seeded, parallel_config=replace(parallel, data_parallel_rank=r,
                                                                 data_parallel_master=master))
            return LLMEngine(seeded, show_progress and r == 0, replica=r, tokenizer=self.tokenizer)

        size = parallel.data_parallel_size
        try:
            if self.lockstep:   # each start-up waits for the others' ranks
                with ThreadPoolExecutor(size) as pool:   # leaving the block waits for every start-up
                    futures = [pool.submit(build, r) for r in range(size)]
                self.replicas = [f.result() for f in futures if f.exception() is None]
                errors = [f.exception() for f in futures if f.exception() is not None]
                if errors:   # the replicas that started are shut down below
                    raise errors[0]
            else:
                for r in range(size):
                    self.replicas.append(build(r))
        except BaseException:
            self.shutdown()
            raise
        self.owner: dict[str, LLMEngine] = {}
        self._ids = 0

    def next_request_id(self) -> str:
        self._ids += 1
        return str(self._ids - 1)

    def load(self, engine: LLMEngine) -> int:
        stats = engine.stats()
        return stats.num_running + stats.num_waiting

    def compile_structured(self, params: SamplingParams) -> None:
        self.replicas[0].compile_structured(params)   # the grammar travels with params to any replica

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> int:
        """Returns the index of the replica that took the request."""
        if request_id in self.owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        index = min(range(len(self.replicas)), key=lambda i: self.load(self.replicas[i]))
        self.replicas[index].add_request(request_id, prompt, params, arrival_time, priority)
        self.owner[request_id] = self.replicas[index]
        return index

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            engine = self.owner.pop(rid, None)
            if engine is not None:
                engine.abort_request(rid)

    def step(self) -> list[RequestOutput]:
        busy = [e for e in self.replicas if e.has_unfinished_requests()]
        if self.lockstep and busy:
            busy = self.replicas
        for engine in busy:
            engine.submit_step(idle_too=self.lockstep)
        return self._release([out for engine in busy for out in engine.finish_step()])

    def _release(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Forget which replica owns the requests these outputs finish."""
        for out in outputs:
            if out.finished:
                self.owner.pop(out.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def finish_in_flight(self) -> list[RequestOutput]:
        return self._release([out for engine in self.replicas for out in engine.finish_in_flight()])

    def start_profile(self) -> None:
        for engine in self.replicas:
            engine.start_profile()

    def stop_profile(self) -> list[str]:
        return [path for engine in self.replicas for path in engine.stop_profile()]

    def stats(self) -> EngineStats:
        parts = [e.stats() for e in self.replicas]
        spec = None
        for part in parts:
            if part.spec_decoding is not None:
                spec = spec or SpecDecodingStats(part.spec_decoding.num_spec_tokens)
                spec.merge(part.spec_decoding)
        return EngineStats(sum(p.num_running for p in parts), sum(p.num_waiting for p in parts),
                           sum(p.kv_cache_usage for p in parts) / len(parts),
                           sum(p.prefix_cache_queries for p in parts), sum(p.prefix_cache_hits for p in parts),
                           sum(p.num_preemptions for p in parts), spec)

    def check_health(self) -> None:
        for engine in self.replicas:
            engine.check_health()

    def shutdown(self) -> None:
        for engine in self.replicas:
            engine.shutdown()
