"""LLMEngine: the synchronous step loop that ties scheduler, executor and output processing.

One `step()`: schedule (token budget, KV blocks) -> executor runs the model on every rank ->
scheduler books the sampled tokens -> outputs are detokenized and returned.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from shardserve.config import EngineConfig
from shardserve.engine.detokenizer import IncrementalDetokenizer
from shardserve.engine.output_processor import OutputProcessor, RequestState, SampleState
from shardserve.engine.request import Request, RequestStatus
from shardserve.engine.scheduler import Scheduler
from shardserve.executor.factory import make_executor
from shardserve.outputs import RequestOutput
from shardserve.sampling_params import InvalidParameter, RequestOutputKind, SamplingParams
from shardserve.spec_decode.stats import SpecDecodingStats
from shardserve.tokenizer.tokenizer import Tokenizer
from shardserve.utils import cdiv
from shardserve.worker.profiler import require_profiler_dir
from shardserve.worker.step_io import SchedulerOutput

if TYPE_CHECKING:   # xgrammar is imported with the first constrained request
    from shardserve.structured.compiler import GrammarCompiler

logger = logging.getLogger("shardserve")

PromptType = str | list[int] | dict[str, Any]


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decoding: SpecDecodingStats | None = None   # with speculative decoding: acceptance counts


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True, replica: int = 0,
                 tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        model_config = config.model_config
        if tokenizer is None and not model_config.skip_tokenizer_init:
            tokenizer = Tokenizer.from_path(model_config.tokenizer or model_config.model)
        self.tokenizer = tokenizer
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else _config_eos_ids(model_config.hf_config)
        self.executor = make_executor(config, self.eos_token_ids, show_progress, replica)
        try:
            num_blocks = self._init_kv_cache()
        except BaseException:   # do not leave worker processes (and their GPU memory) behind
            self.executor.shutdown()
            raise
        # With pipeline stages, one scheduler per stage ("virtual engines", each over its own slice
        # of the KV pool) keeps that many batches in flight, so the stages work at the same time.
        pp = config.parallel_config.pipeline_parallel_size
        per_ve = num_blocks // pp
        if pp > 1 and (per_ve - 1) * config.cache_config.block_size < config.model_config.max_model_len:
            logger.warning("KV cache too small to split over %d pipeline micro-batches; stages will take turns", pp)
            pp, per_ve = 1, num_blocks
        self.schedulers = [Scheduler(config.scheduler_config, config.cache_config, per_ve, block_offset=v * per_ve,
                                     speculative_config=config.speculative_config) for v in range(pp)]
        self.in_flight: deque[tuple[Scheduler, SchedulerOutput]] = deque()
        self.async_scheduling = config.scheduler_config.async_scheduling and len(self.schedulers) == 1
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self.profiling = False   # the workers' torch profilers (start_profile / stop_profile)

    @property
    def scheduler(self) -> Scheduler:
        """The first (and, without pipeline parallelism, only) scheduler."""
        return self.schedulers[0]

    def _init_kv_cache(self) -> int:
        block_size = self.config.cache_config.block_size
        max_len = self.config.model_config.max_model_len
        num_blocks = self.executor.determine_num_blocks()
        tokens = (num_blocks - 1) * block_size   # block 0 is reserved
        per_block = self.executor.kv_bytes_per_block()
        if tokens < max_len:
            need = (cdiv(max_len, block_size) + 1) * per_block
            raise ValueError(
                f"the KV cache holds {max(tokens, 0)} tokens ({num_blocks * per_block / 2**30:.3f} GiB) but one "
                f"request of max_model_len={max_len} tokens needs at least {need / 2**30:.3f} GiB "
                f"({need} bytes): raise --kv-cache-memory (or --gpu-memory-utilization), or lower --max-model-len")
        self.executor.initialize_kv_cache(num_blocks)
        logger.info("KV cache size: %d tokens (%d blocks of %d, %.2f GiB)", tokens, num_blocks - 1, block_size,
                    num_blocks * per_block / 2**30)
        logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_len, tokens / max_len)
        return num_blocks

    # ---- requests --------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this engine was built with skip_tokenizer_init")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def _validate_prompt(self, token_ids: list[int]) -> None:
        max_len = self.config.model_config.max_model_len
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(token_ids) > max_len:
            raise ValueError(f"the prompt ({len(token_ids)} tokens) is longer than the maximum model length "
                             f"of {max_len} tokens")
        vocab = self.config.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def compile_structured(self, params: SamplingParams) -> None:
        """Compile the request's grammar (cached per spec) unless it is already compiled. Thread-safe:
        AsyncLLMEngine calls it from a pool thread so the engine loop never compiles; add_request
        calls it too (offline, or a spec nobody compiled yet). Raises ValueError for a bad spec."""
        spec = params.structured_outputs
        if spec is None or spec.compiled is not None:
            return
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from shardserve.structured.compiler import GrammarCompiler
                if self.tokenizer is None:
                    raise ValueError("structured_outputs needs a tokenizer; this engine was built with "
                                     "skip_tokenizer_init")
                tok = self.tokenizer
                self._grammar_compiler = GrammarCompiler(tok.backend, self.config.model_config.vocab_size,
                                                         self.eos_token_ids, tok.all_special_ids)
        self._grammar_compiler.compile(spec)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request. `priority` (lower runs first) needs `scheduling_policy="priority"`."""
        if priority and self.config.scheduler_config.policy != "priority":
            raise InvalidParameter(f"priority={priority} needs priority scheduling: start the engine with "
                                   "--scheduling-policy priority", "priority")
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameter("cache_salt must be a non-empty string", "cache_salt")
        self.compile_structured(params)
        text, token_ids = self.tokenize_prompt(prompt)
        self._validate_prompt(token_ids)
        limit = self.config.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and limit != -1 and (k == -1 or k > limit):
                raise ValueError(f"{name}={k} exceeds this engine's max_logprobs={limit} "
                                 "(start it with a larger max_logprobs, or -1 for no limit)")
        vocab = self.config.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab})")
        bad = sorted(t for t in params.logit_bias or {} if t >= vocab)
        if bad:
            raise InvalidParameter(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                                   "logit_bias")
        eos = self.eos_token_ids
        children = [params] if params.n == 1 else [params.for_child(i) for i in range(params.n)]
        samples, engine_ids, requests = [], [], []
        for i, child in enumerate(children):
            if i > 0 and child.prompt_logprobs is not None:   # computed once, for the first sample
                child = replace(child, prompt_logprobs=None)
            # n > 1: internal ids with a separator clients cannot send in JSON strings unnoticed.
            rid = request_id if params.n == 1 else f"{request_id}\x1f{i}"
            detok = (IncrementalDetokenizer(self.tokenizer, token_ids, child)
                     if self.tokenizer is not None and child.detokenize else None)
            samples.append(SampleState(i, detok))
            engine_ids.append(rid)
            requests.append(Request(rid, token_ids, child, eos, arrival_time or time.monotonic(), priority=priority,
                                    cache_salt=cache_salt))
        if request_id in self.output_processor.requests or any(self._id_in_use(r) for r in engine_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        self.output_processor.add(RequestState(request_id, text, token_ids, samples, final_only=final_only),
                                  engine_ids)
        scheduler = min(self.schedulers, key=lambda scheduler: len(scheduler.running) + len(scheduler.waiting))
        for req in requests:
            scheduler.add_request(req)

    def _id_in_use(self, engine_id: str) -> bool:
        # Includes ids finished but not yet reported to the workers, whose state is shared by all
        # schedulers: reusing one too early would let a stale "finished" drop the new request's state.
        return any(engine_id in scheduler.requests or engine_id in scheduler.finished_req_ids
                   for scheduler in self.schedulers) or any(
            engine_id in sched.finished_req_ids for _, sched in self.in_flight)

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            engine_ids = self.output_processor.abort(request_id)
            for scheduler in self.schedulers:
                scheduler.finish_requests(engine_ids, RequestStatus.FINISHED_ABORTED)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.submit_step()
        return self.finish_step()

    def submit_step(self, idle_too: bool = False) -> None:
        """Schedule and hand a batch to the workers for every scheduler without one in flight (with
        async scheduling: until two batches are in flight). idle_too: a scheduler with no requests
        submits an empty step as well (replicas whose experts span each other step together)."""
        if self.async_scheduling:
            return self._submit_ahead()
        busy = {id(scheduler) for scheduler, _ in self.in_flight}
        for scheduler in self.schedulers:
            if id(scheduler) not in busy and (idle_too or scheduler.has_unfinished_requests()):
                sched = scheduler.schedule()
                self.executor.submit_execute(sched)
                self.in_flight.append((scheduler, sched))

    def _submit_ahead(self) -> None:
        """Keep a second step in flight: it is scheduled, sent and prepared while the device runs the
        first. Its decodes take their input tokens from the device (the first step's samples); the
        price is that a request stopped by the first step's token (EOS, a stop string) computes one
        token more, which is dropped."""
        scheduler = self.scheduler
        while len(self.in_flight) < 2 and scheduler.has_unfinished_requests():
            if self.in_flight and scheduler.wants_drafts:   # speculative decoding: n-gram drafts need the
                return                                    # in-flight step's tokens before the next step
            sched = scheduler.schedule()
            if sched.is_empty and self.in_flight:   # every running request awaits its token
                scheduler.finished_req_ids |= sched.finished_req_ids   # tell the workers with the next step
                return
            self.executor.submit_execute(sched)
            self.in_flight.append((scheduler, sched))

    def finish_step(self) -> list[RequestOutput]:
        """Collect the oldest batch in flight and turn its tokens into outputs."""
        if not self.in_flight:
            return []
        scheduler, sched = self.in_flight.popleft()
        result = self.executor.collect_execute()
        updates = scheduler.update_from_output(sched, result)
        outputs, stopped = self.output_processor.process(updates)
        if stopped:
            scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.in_flight) or any(scheduler.has_unfinished_requests() for scheduler in self.schedulers)

    def finish_in_flight(self) -> list[RequestOutput]:
        """Collect every batch in flight (without submitting more): the workers are then idle, so
        a control RPC's answer cannot be mistaken for a step's."""
        outputs = []
        while self.in_flight:
            outputs += self.finish_step()
        return outputs

    # ---- profiling (worker/profiler.py) ----------------------------------------------------
    def start_profile(self) -> None:
        directory = require_profiler_dir()
        if self.profiling:   # checked here: a worker's error would stop the engine
            raise ValueError("the profiler is already running: stop it first")
        self._require_no_steps_in_flight()
        self.executor.collective_rpc("start_profile", (directory,))
        self.profiling = True

    def stop_profile(self) -> list[str]:
        """Stops every worker's profiler; returns the trace files, in rank order."""
        if not self.profiling:
            raise ValueError("the profiler is not running: start it first")
        self._require_no_steps_in_flight()
        self.profiling = False
        return self.executor.collective_rpc("stop_profile")

    def _require_no_steps_in_flight(self) -> None:
        if self.in_flight:
            raise RuntimeError("steps are in flight: call finish_in_flight() first")

    def stats(self) -> EngineStats:
        kvs = [scheduler.kv for scheduler in self.schedulers]
        spec = None
        if self.config.speculative_config is not None:
            spec = SpecDecodingStats(self.config.speculative_config.num_speculative_tokens)
            for scheduler in self.schedulers:
                spec.merge(scheduler.spec_stats)
        return EngineStats(sum(len(scheduler.running) for scheduler in self.schedulers),
                           sum(len(scheduler.waiting) for scheduler in self.schedulers),
                           sum(kv.usage() for kv in kvs) / len(kvs), sum(kv.prefix_cache_queries for kv in kvs),
                           sum(kv.prefix_cache_hits for kv in kvs),
                           sum(scheduler.num_preemptions for scheduler in self.schedulers), spec)

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()



def _config_eos_ids(hf_config: dict[str, Any]) -> frozenset[int]:
    """EOS ids from config.json when no tokenizer is loaded (skip_tokenizer_init)."""
    eos = hf_config.get("eos_token_id")
    return frozenset(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
