"""Continuous batching on a token budget.

Each step the scheduler spends at most `max_num_batched_tokens` tokens: running requests first (a
decode costs one token, an unfinished prefill gets the next chunk), then waiting requests in FCFS
order while `max_num_seqs` allows. When the KV pool runs dry, the most recently admitted running
request is preempted: its blocks are freed and it goes back to the head of the queue to be
recomputed later (vLLM's recompute preemption). A step that preempted admits nobody new.

`--scheduling-policy priority` (vLLM's): both queues are kept in order of (priority, arrival time),
lower first. So the most urgent waiting request is admitted first, running requests get their
tokens in that order, and the one preempted when the pool runs dry is the least urgent (latest of
the lowest priority); it goes back into the waiting queue at its own place in that order. A
waiting request does not preempt running ones: it waits for their blocks like any other.

Workers keep each request's tokens and block ids between steps; `num_synced_tokens` and
`num_synced_blocks` on the request say how much of them the workers hold, so each step sends
only what is new.

Speculative decoding: a decoding request with drafts (`Request.spec_token_ids`, from the n-gram
proposer or the draft model) is scheduled for 1 + len(drafts) tokens, which the workers verify in
one forward pass. Its computed count then covers the drafts; when the result comes back the
rejected ones are taken off again. Their KV slots hold stale values only past the computed count,
where the next step writes before anything reads them: that is the whole rollback.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass

from shardserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from shardserve.engine.kv_cache import HASH_ALGOS, KVCacheBlock, KVCacheManager
from shardserve.engine.request import Request, RequestStatus
from shardserve.spec_decode.ngram import propose_ngram
from shardserve.spec_decode.stats import SpecDecodingStats
from shardserve.worker.step_io import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput


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
                 kv_manager: KVCacheManager | None = None, block_offset: int = 0,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        self.config = scheduler_config
        self.spec = speculative_config
        self.spec_stats = SpecDecodingStats(speculative_config.num_speculative_tokens) if speculative_config else None
        # A draft model writes KV for its drafts past a request's known tokens: slots reserved ahead.
        self.lookahead = (speculative_config.num_speculative_tokens
                          if speculative_config and speculative_config.method == "draft_model" else 0)
        # Pipeline-parallel engines run several schedulers over disjoint slices of one KV pool.
        self.block_offset = block_offset
        self.max_model_len = scheduler_config.max_model_len
        self.kv = kv_manager or KVCacheManager(
            num_blocks=num_blocks, block_size=cache_config.block_size,
            enable_prefix_caching=cache_config.enable_prefix_caching,
            hash_fn=HASH_ALGOS[cache_config.prefix_caching_hash_algo])
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0

    # ---- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._enqueue(self.waiting, request)
        self.requests[request.request_id] = request

    def _enqueue(self, queue: deque[Request] | list[Request], req: Request, first: bool = False) -> None:
        """Into `queue` at its place: by (priority, arrival) under the priority policy; else at the
        back, or at the front (`first`: a preempted request, which was admitted before the rest)."""
        if self.config.policy == "priority":
            bisect.insort(queue, req, key=_urgency)
        elif first:
            queue.appendleft(req)
        else:
            queue.append(req)

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
        """One step on one budget of `max_num_batched_tokens`: running requests first, then waiting
        ones, unless making room for the running ones preempted someone."""
        output = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        num_preemptions_before = self.num_preemptions
        token_budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        if self.num_preemptions == num_preemptions_before:   # a pool that just ran dry admits nobody
            self._schedule_waiting(output, token_budget)
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        return output

    def _schedule_running(self, output: SchedulerOutput, token_budget: int) -> int:
        """Give running requests, oldest first, their next tokens (a decode is one, an unfinished
        prefill the next chunk) while the budget lasts. Returns the budget left."""
        index = 0
        while index < len(self.running) and token_budget > 0:
            req = self.running[index]
            index += 1
            num_new_tokens = min(self._num_tokens_ready(req), token_budget)
            if num_new_tokens == 0:
                continue
            drafts = self._drafts_to_verify(req, token_budget) if req.spec_token_ids else []
            num_new_tokens += len(drafts)
            if not self._make_room(req, num_new_tokens + self.lookahead, output):
                break   # it preempted itself, after everything admitted later than it
            self.kv.allocate(req.request_id, req.all_token_ids,
                             req.num_computed_tokens + num_new_tokens + self.lookahead)
            output.scheduled_cached_reqs.append(self._cached_request_data(req))
            self._mark_synced(req)
            if drafts:
                output.scheduled_spec_decode_tokens[req.request_id] = drafts
            self._schedule_tokens(req, num_new_tokens, output)
            token_budget -= num_new_tokens
        return token_budget

    def _schedule_waiting(self, output: SchedulerOutput, token_budget: int) -> int:
        """Admit waiting requests in FCFS order while the budget, `max_num_seqs` and the KV pool
        allow; a head that does not fit blocks everyone behind it. Returns the budget left."""
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit_blocks, num_hit_tokens = self._prefix_hits(req)
            num_new_tokens = req.num_tokens - num_hit_tokens
            if num_new_tokens > token_budget and not self.config.enable_chunked_prefill:
                break
            num_new_tokens = min(num_new_tokens, token_budget)
            num_total_tokens = num_hit_tokens + num_new_tokens
            if not self.kv.can_allocate(req.request_id, num_total_tokens + self.lookahead, hit_blocks):
                break
            self.kv.allocate(req.request_id, req.all_token_ids, num_total_tokens + self.lookahead, hit_blocks,
                             req.cache_salt)
            self.kv.record_prefix_lookup(req.num_tokens, num_hit_tokens)
            self.waiting.popleft()
            self._start_running(req, num_hit_tokens)
            output.scheduled_new_reqs.append(self._new_request_data(req))
            self._mark_synced(req)
            self._schedule_tokens(req, num_new_tokens, output)
            token_budget -= num_new_tokens
        return token_budget

    def _drafts_to_verify(self, req: Request, token_budget: int) -> list[int]:
        """The drafts a decoding request verifies this step: as many as the token budget and its
        length limits leave room for (each accepted draft is an output token)."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if req.num_computed_tokens != req.num_tokens - 1:
            return []   # not decoding (recomputing after preemption): the drafts are stale
        room = min(token_budget, req.max_total_tokens(self.max_model_len) - req.num_tokens) - 1
        return drafts[:max(room, 0)]

    def _num_tokens_ready(self, req: Request) -> int:
        """Tokens a running request could compute now: 0 while its last token is still being
        sampled (async scheduling), and 0 once that pending token is the last one it may have."""
        num_known_or_pending = req.num_tokens + req.num_output_placeholders
        if num_known_or_pending >= req.max_total_tokens(self.max_model_len):
            return 0
        return max(0, num_known_or_pending - req.num_computed_tokens)

    def _prefix_hits(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Cached leading blocks of a waiting request and the tokens they hold; none when it asks
        for prompt logprobs, which need every position computed."""
        if req.sampling_params.prompt_logprobs is not None:
            return [], 0
        return self.kv.get_computed_blocks(req.request_id, req.all_token_ids, req.cache_salt)

    def _make_room(self, req: Request, num_new_tokens: int, output: SchedulerOutput) -> bool:
        """Preempt the last running requests (the most recently admitted; the least urgent under the
        priority policy) until `req`'s next tokens fit in the KV pool. Returns False if `req` itself
        had to go (everything after it went first)."""
        while not self.kv.can_allocate(req.request_id, req.num_computed_tokens + num_new_tokens):
            victim = self.running.pop()
            self._preempt(victim, output)
            if victim is req:
                return False
        return True

    def _start_running(self, req: Request, num_hit_tokens: int) -> None:
        """Move an admitted request (already off the waiting queue) to running, its prefix hits
        counted as computed."""
        self._enqueue(self.running, req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()

    def _new_request_data(self, req: Request) -> NewRequestData:
        """All the workers need to start holding `req`: its whole token list and block table."""
        return NewRequestData(req_id=req.request_id, token_ids=req.all_token_ids,
                              num_prompt_tokens=req.num_prompt_tokens, sampling_params=req.sampling_params,
                              block_ids=self._block_ids(req.request_id),
                              num_computed_tokens=req.num_computed_tokens)

    def _cached_request_data(self, req: Request) -> CachedRequestData:
        """What the workers lack of `req`: the tokens and block ids added since they last saw it."""
        return CachedRequestData(req_id=req.request_id,
                                 new_token_ids=req.all_token_ids[req.num_synced_tokens:],
                                 new_block_ids=self._block_ids(req.request_id, req.num_synced_blocks),
                                 num_computed_tokens=req.num_computed_tokens)

    def _mark_synced(self, req: Request) -> None:
        """The workers now hold all of `req`'s tokens and block ids."""
        req.num_synced_tokens = req.num_tokens
        req.num_synced_blocks = self.kv.num_blocks(req.request_id)

    @staticmethod
    def _schedule_tokens(req: Request, num_new_tokens: int, output: SchedulerOutput) -> None:
        """Put `num_new_tokens` of `req` in this step and count them as computed; a chunk that
        reaches the end samples a token."""
        output.num_scheduled_tokens[req.request_id] = num_new_tokens
        req.num_computed_tokens += num_new_tokens
        if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:   # > with drafts
            req.num_output_placeholders += 1

    def _block_ids(self, req_id: str, start: int = 0) -> list[int]:
        return [block_id + self.block_offset for block_id in self.kv.block_ids(req_id, start)]

    def _preempt(self, req: Request, output: SchedulerOutput) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = req.num_output_placeholders = 0
        req.num_synced_tokens = req.num_synced_blocks = 0
        req.spec_token_ids, req.wants_drafts = [], False
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(self.waiting, req, first=True)
        output.finished_req_ids.add(req.request_id)   # workers drop it; it comes back as new

    # ---- after the model ran ---------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           result: ModelRunnerOutput) -> list[RequestUpdate]:
        updates = []
        for req_id in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None:
                continue   # finished or aborted while the step ran
            running = req.status == RequestStatus.RUNNING
            prompt_logprobs = result.prompt_logprobs.get(req_id) if running else None
            tokens = result.sampled_token_ids.get(req_id)
            computed_end = _computed_end(scheduler_output, req_id) if prompt_logprobs else 0
            if tokens is None:
                if prompt_logprobs:
                    updates.append(RequestUpdate(request=req, new_token_ids=[], finished=False,
                                                 prompt_logprobs=prompt_logprobs, computed_end=computed_end))
                continue
            # A request preempted while this step ran still gets its token: it was computed from
            # the right context, and the recompute will include it.
            if running:
                req.num_output_placeholders -= 1
                drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
                if drafts:   # the rejected drafts were not computed after all
                    req.num_computed_tokens -= len(drafts) + 1 - len(tokens)
                    self.spec_stats.observe(len(drafts), len(tokens) - 1)
            status, appended = None, []
            for token in tokens:
                req.append_token(token)
                appended.append(token)
                status = req.check_stop_token(self.max_model_len)
                if status is not None:   # tokens after a stop are dropped
                    break
            if status is not None:
                (self.running if running else self.waiting).remove(req)
                self._free(req, status)
            elif running and self.spec is not None:
                self._propose(req, result)
            updates.append(RequestUpdate(request=req, new_token_ids=appended, finished=status is not None,
                                         logprobs=result.logprobs.get(req_id),
                                         prompt_logprobs=prompt_logprobs, computed_end=computed_end))
        return updates

    def _propose(self, req: Request, result: ModelRunnerOutput) -> None:
        """Drafts for the request's next step: the draft model's (they came with the result) or
        n-gram matches in its context; none where its sampling does not take drafts
        (`SamplingParams.takes_drafts`).

        With async scheduling (n-gram only) the request may have its next step in flight already:
        drafts made now would follow a token that is not its last, so they are dropped, and the
        request asks the engine to hold the step after (`wants_drafts`) so that its next proposal
        sees every token."""
        if not req.sampling_params.takes_drafts:
            return
        spec = self.spec
        if spec.method == "ngram":
            drafts = propose_ngram(req.all_token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max,
                                   spec.num_speculative_tokens)
        else:
            drafts = result.draft_token_ids.get(req.request_id, [])
        if req.num_output_placeholders:
            req.wants_drafts = bool(drafts)
        else:
            req.spec_token_ids, req.wants_drafts = drafts, False

    @property
    def wants_drafts(self) -> bool:
        """A running request found drafts while its next step was in flight: the engine should not
        schedule another step ahead of that one's result (engine._submit_ahead)."""
        return self.spec is not None and any(req.wants_drafts for req in self.running)


def _computed_end(scheduler_output: SchedulerOutput, req_id: str) -> int:
    """Where a request's computed tokens stood after `scheduler_output` ran (the scheduler's own
    count may already include the next step's chunk)."""
    scheduled = (*scheduler_output.scheduled_new_reqs, *scheduler_output.scheduled_cached_reqs)
    start = next(data.num_computed_tokens for data in scheduled if data.req_id == req_id)
    return start + scheduler_output.num_scheduled_tokens[req_id]


def _urgency(req: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return req.priority, req.arrival_time
