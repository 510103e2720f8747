"""Acceptance counts, kept by the scheduler and exported under vLLM's `vllm:spec_decode_*` names."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0              # verification steps of one request that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [k]: drafts accepted at each position

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for pos, count in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[pos] += count

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields on average: the accepted drafts plus the one the target
        always adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
