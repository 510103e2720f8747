"""A request as the scheduler sees it: tokens so far and how many of them the KV cache holds.

The scheduler thinks in tokens only: `num_computed_tokens` catches up with `num_tokens`. A prompt
is a request whose computed count lags far behind; a decode lags by one; a prefix hit starts ahead;
a preempted request drops back to zero and recomputes (its output tokens included). The computed
count moves when a step is scheduled; a step that reaches the last token will sample one more, not
yet known (`num_output_placeholders`) until its result comes back. With async scheduling the next
step is scheduled before that, and the workers feed the sampled token in from the device.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from shardserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0                    # --scheduling-policy priority: lower runs first
    cache_salt: str | None = None        # prefix-cache hits only among requests of the same salt
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0     # tokens being sampled by steps in flight
    num_cached_tokens: int = -1          # prefix-cache hit on first scheduling (-1: not yet)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_synced_tokens: int = 0           # how many of our tokens the workers already hold
    num_synced_blocks: int = 0           # ... and how many of our block ids
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    spec_token_ids: list[int] = field(default_factory=list)   # drafts to verify at the next step
    wants_drafts: bool = False   # found drafts while its next step was in flight (async scheduling)
    _all_token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs, kept as one list so each step costs O(new tokens), not O(context).
        Callers must not modify it."""
        if len(self._all_token_ids) != self.num_tokens:   # first use, or outputs set directly
            self._all_token_ids = self.prompt_token_ids + self.output_token_ids
        return self._all_token_ids

    def max_total_tokens(self, max_model_len: int) -> int:
        mt = self.sampling_params.max_tokens
        return max_model_len if mt is None else min(max_model_len, self.num_prompt_tokens + mt)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if len(self._all_token_ids) == self.num_tokens - 1:
            self._all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def check_stop_token(self, max_model_len: int) -> RequestStatus | None:
        """Stop conditions decided by token ids alone (stop strings are the detokenizer's job)."""
        sp = self.sampling_params
        last = self.output_token_ids[-1]
        # A grammar decides where a constrained answer may end: its EOS stops it even before min_tokens.
        if self.num_output_tokens >= sp.min_tokens or (sp.structured_outputs is not None
                                                       and not sp.ignore_eos and last in self.eos_token_ids):
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_tokens >= self.max_total_tokens(max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None
