"""Turns per-step token updates into RequestOutputs: detokenizes, applies stop strings, formats
logprobs, and folds the n samples of one request back together."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from shardserve.engine.detokenizer import IncrementalDetokenizer
from shardserve.engine.request import Request
from shardserve.engine.scheduler import RequestUpdate
from shardserve.outputs import CompletionOutput, Logprob, RequestOutput
from shardserve.tokenizer.tokenizer import Tokenizer


@dataclass
class SampleState:
    """One of a request's n samples (one engine request)."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestState:
    """A user request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    metrics: dict[str, float] = field(default_factory=dict)
    final_only: bool = False   # SamplingParams.output_kind FINAL_ONLY: no output until it finishes

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}      # by user request id
        self.sample_of: dict[str, tuple[RequestState, SampleState]] = {}   # by engine request id

    def add(self, state: RequestState, engine_req_ids: list[str]) -> None:
        self.requests[state.request_id] = state
        for rid, sample in zip(engine_req_ids, state.samples):
            self.sample_of[rid] = (state, sample)

    def _decoded(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None

    def _logprob_dict(self, row: tuple[list[int], list[float], list[int]]) -> dict[int, Logprob]:
        ids, lps, ranks = row
        return {t: Logprob(lp, r, self._decoded(t)) for t, lp, r in zip(ids, lps, ranks)}

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of requests that changed and the engine request ids that a stop
        string finished (the scheduler must free them)."""
        changed: dict[str, RequestState] = {}
        stopped: list[str] = []
        now = time.monotonic()
        for up in updates:
            entry = self.sample_of.get(up.request.request_id)
            if entry is None:
                continue
            state, sample = entry
            req = up.request
            if up.prompt_logprobs:
                if state.prompt_logprobs is None:
                    state.prompt_logprobs = [None]
                # The rows end at the last computed prompt position. A preempted request recomputes
                # its prompt and sends rows again: they replace, not follow, what we already hold.
                end = min(up.computed_end, len(state.prompt_token_ids) - 1)
                del state.prompt_logprobs[end - len(up.prompt_logprobs) + 1:]
                state.prompt_logprobs.extend(self._logprob_dict(r) for r in up.prompt_logprobs)
            if up.new_token_ids:
                self._add_tokens(state, sample, req, up, stopped)
                if sample.finish_reason is not None:
                    del self.sample_of[req.request_id]
                state.num_cached_tokens = max(req.num_cached_tokens, 0)
                state.metrics.setdefault("first_token_time", now)
                if req.first_scheduled_time is not None:
                    state.metrics.setdefault("first_scheduled_time", req.first_scheduled_time)
            changed[state.request_id] = state
        outputs = []
        for state in changed.values():
            finished = state.finished
            if finished or not state.final_only:
                outputs.append(self._make_output(state))
            if finished:
                state.metrics["finished_time"] = now
                self.requests.pop(state.request_id, None)
        return outputs, stopped

    def _add_tokens(self, state: RequestState, sample: SampleState, req: Request, up: RequestUpdate,
                    stopped: list[str]) -> None:
        sample.token_ids.extend(up.new_token_ids)
        if up.logprobs is not None:
            sample.logprobs = sample.logprobs or []
            sample.logprobs.append(self._logprob_dict(up.logprobs))
            sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + up.logprobs[1][0]
        stop_str = None
        sp = req.sampling_params
        if sample.detokenizer is not None and sp.detokenize:
            text_ids = up.new_token_ids
            if up.finished and req.status.value == "stop" and not sp.include_stop_str_in_output:
                text_ids = text_ids[:-1]   # an EOS or stop token ends the text without appearing in it
            if len(text_ids) > 1 and sp.stop_strings:   # accepted drafts: stop at the token that completes one
                stop_str = self._add_one_by_one(sample, len(sample.token_ids) - len(up.new_token_ids), text_ids)
            else:
                stop_str = sample.detokenizer.add_tokens(text_ids, req.num_output_tokens)
        if stop_str is not None:   # a stop string wins over a length limit reached on the same token
            sample.finish_reason, sample.stop_reason = "stop", stop_str
            if not up.finished:
                stopped.append(req.request_id)
        elif up.finished:
            sample.finish_reason = req.status.value
            sample.stop_reason = req.stop_reason

    @staticmethod
    def _add_one_by_one(sample: SampleState, first: int, token_ids: list[int]) -> str | None:
        """Several tokens from one step (speculative decoding), the first of them at output index
        `first`: the one that completes a stop string ends the output, as it would have without
        drafts; the tokens after it are dropped."""
        for i, token_id in enumerate(token_ids):
            stop_str = sample.detokenizer.add_tokens([token_id], first + i + 1)
            if stop_str is not None:
                del sample.token_ids[first + i + 1:]
                return stop_str
        return None

    def _make_output(self, state: RequestState) -> RequestOutput:
        completions = []
        for s in state.samples:
            text = s.detokenizer.releasable_text(s.finish_reason is not None) if s.detokenizer else ""
            completions.append(CompletionOutput(s.index, text, list(s.token_ids), s.cumulative_logprob,
                                                s.logprobs, s.finish_reason, s.stop_reason))
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, state.finished,
                             state.prompt_logprobs, state.num_cached_tokens, dict(state.metrics,
                                                                                  arrival_time=state.arrival_time))

    def abort(self, request_id: str) -> list[str]:
        """Forget a user request; returns the engine request ids to abort."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        rids = [rid for rid, (st, _) in self.sample_of.items() if st is state]
        for rid in rids:
            self.sample_of.pop(rid)
        return rids
