"""Continuous batching on a token budget.

Each step the scheduler spends at most `max_num_batched_tokens` tokens: running requests first (a
decode costs one token, an unfinished prefill gets the next chunk), then waiting requests in FCFS
order while `max_num_seqs` allows. When the KV pool runs dry, the most recently admitted running
request is preempted: its blocks are freed and it goes back to the head of the queue to be
recomputed later (vLLM's recompute preemption).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from shardserve.config import CacheConfig, SchedulerConfig
from shardserve.engine.kv_cache import HASH_ALGOS, KVCacheManager
from shardserve.engine.request import Request, RequestStatus
from shardserve.engine.scheduler_output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                                SchedulerOutput)


@dataclass
class RequestUpdate:
    """What one step did to one request: the tokens it gained and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finished: bool
    logprobs: tuple[list[int], list[float], list[int]] | None = None
    prompt_logprobs: list[tuple[list[int], list[float], list[int]]] | None = None
    computed_end: int = 0   # with prompt_logprobs: tokens computed once this step ran


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 kv_manager: KVCacheManager | None = None, block_offset: int = 0) -> None:
        self.config = scheduler_config
        # Pipeline-parallel engines run several schedulers over disjoint slices of one KV pool.
        self.block_offset = block_offset
        self.max_model_len = scheduler_config.max_model_len
        self.kv = kv_manager or KVCacheManager(num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching,
                                               HASH_ALGOS[cache_config.prefix_caching_hash_algo])
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0

    # ---- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) requests wherever they are; frees their blocks."""
        done = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._free(req, status)
            done.append(req)
        return done

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget = self.config.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            known_or_pending = req.num_tokens + req.num_output_placeholders
            if (known_or_pending <= req.num_computed_tokens
                    or known_or_pending >= req.max_total_tokens(self.max_model_len)):
                i += 1   # its last token is still being sampled (async scheduling): nothing to run yet
                continue
            num_new = min(known_or_pending - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req.request_id, req.all_token_ids, req.num_computed_tokens,
                                         num_new) is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            self._schedule_running(req, num_new, out)
            self._advance(req, num_new)
            budget -= num_new
            i += 1

        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            hits, num_hit = [], 0
            if req.sampling_params.prompt_logprobs is None:   # prompt logprobs need every position computed
                hits, num_hit = self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
            num_new = req.num_tokens - num_hit
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req.request_id, req.all_token_ids, num_hit, num_new, hits) is None:
                break
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            out.scheduled_new_reqs.append(NewRequestData(
                req.request_id, req.all_token_ids, req.num_prompt_tokens, req.sampling_params,
                self._block_ids(req.request_id), num_hit))
            req.num_synced_tokens = req.num_tokens
            req.num_synced_blocks = len(self.kv.req_blocks[req.request_id])
            out.num_scheduled_tokens[req.request_id] = num_new
            self._advance(req, num_new)
            budget -= num_new

        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        return out

    def _schedule_running(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        block_ids = self._block_ids(req.request_id)
        # Workers hold the tokens and block ids they were sent; send only what is new.
        out.scheduled_cached_reqs.append(CachedRequestData(
            req.request_id, req.all_token_ids[req.num_synced_tokens:],
            block_ids[req.num_synced_blocks:], req.num_computed_tokens))
        req.num_synced_tokens = req.num_tokens
        req.num_synced_blocks = len(block_ids)
        out.num_scheduled_tokens[req.request_id] = num_new

    @staticmethod
    def _advance(req: Request, num_new: int) -> None:
        """Count the scheduled tokens as computed; a chunk that reaches the end samples a token."""
        req.num_computed_tokens += num_new
        if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:
            req.num_output_placeholders += 1

    def _block_ids(self, req_id: str) -> list[int]:
        return [b + self.block_offset for b in self.kv.block_ids(req_id)]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = req.num_output_placeholders = 0
        req.num_synced_tokens = req.num_synced_blocks = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.finished_req_ids.add(req.request_id)   # workers drop it; it comes back as new

    # ---- after the model ran ---------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        updates = []
        for req_id in sched.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None:
                continue   # finished or aborted while the step ran
            running = req.status == RequestStatus.RUNNING
            prompt_lps = result.prompt_logprobs.get(req_id) if running else None
            token = result.sampled_token_ids.get(req_id)
            end = _computed_end(sched, req_id) if prompt_lps else 0
            if token is None:
                if prompt_lps:
                    updates.append(RequestUpdate(req, [], False, prompt_logprobs=prompt_lps, computed_end=end))
                continue
            # A request preempted while this step ran still gets its token: it was computed from
            # the right context, and the recompute will include it.
            if running:
                req.num_output_placeholders -= 1
            req.append_token(token)
            status = req.check_stop_token(self.max_model_len)
            if status is not None:
                (self.running if running else self.waiting).remove(req)
                self._free(req, status)
            updates.append(RequestUpdate(req, [token], status is not None,
                                         result.logprobs.get(req_id), prompt_lps, end))
        return updates


def _computed_end(sched: SchedulerOutput, req_id: str) -> int:
    """Where a request's computed tokens stood after `sched` ran (the scheduler's own count may
    already include the next step's chunk)."""
    start = next(r.num_computed_tokens for r in (*sched.scheduled_new_reqs, *sched.scheduled_cached_reqs)
                 if r.req_id == req_id)
    return start + sched.num_scheduled_tokens[req_id]
