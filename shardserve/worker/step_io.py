"""What the scheduler hands to the workers each step. Plain picklable data: the same object is
broadcast to every rank by the multi-process executors.

Workers keep per-request state between steps, so a request's full token list and sampling
parameters travel once (`NewRequestData`); later steps send only what changed (`CachedRequestData`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]          # prompt + any outputs (a resumed request recomputes them)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_id: str
    new_token_ids: list[int]      # tokens appended since the workers last saw this request
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)   # workers drop their state for these
    # Speculative decoding: draft tokens to verify after a request's last token (they are also
    # counted in num_scheduled_tokens: 1 + len(drafts)).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Sampled tokens (only for requests whose scheduled chunk reached their last token: one, or with
    drafts the accepted ones plus one) and the logprobs asked for. Logprobs are (token_ids, logprobs,
    ranks) rows: first the sampled token. draft_token_ids: a draft model's proposals for the next step."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, tuple[list[int], list[float], list[int]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], list[int]]]] = field(default_factory=dict)
