"""Incremental detokenization and stop strings.

Text is produced by decoding a short sliding window of tokens and keeping only what the newest
tokens add. A window that ends inside a multi-byte character decodes to U+FFFD; such text is held
back until the character is complete, so streamed deltas never contain broken characters.
Stop strings are searched in the newly added text (plus an overlap for strings that straddle
deltas); the stop string itself is not emitted. Text that could still turn into a stop string is
not released to streaming clients (`releasable_text`).
"""
from __future__ import annotations

from shardserve.sampling_params import SamplingParams
from shardserve.tokenizer.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5   # prompt tokens kept in the window so the first output token decodes in context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.tokens = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""
        self.stop_hold = max((len(s) for s in params.stop_strings), default=1) - 1

    def add_tokens(self, new_token_ids: list[int], num_output_tokens: int) -> str | None:
        """Append tokens; returns the stop string if one now ends the output (text truncated)."""
        checked = len(self.output_text)
        for token_id in new_token_ids:
            self.tokens.append(token_id)
            self.output_text += self._next_piece()
        if not self.params.stop_strings or num_output_tokens < self.params.min_tokens:
            return None
        return self._check_stop(max(0, checked - self.stop_hold))

    def _next_piece(self) -> str:
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset], skip)
        full = self.tokenizer.decode(self.tokens[self.prefix_offset:], skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix):]
        return ""

    def _check_stop(self, start: int) -> str | None:
        # Only text from `start` can hold a new match: the new text plus an overlap for stop
        # strings that straddle the previous delta.
        best: tuple[int, str] | None = None
        for stop in self.params.stop_strings:
            idx = self.output_text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.output_text = self.output_text[:end]
        return stop

    def releasable_text(self, finished: bool) -> str:
        """Output text safe to show a streaming client now."""
        if finished or not self.stop_hold:
            return self.output_text
        return self.output_text[:max(0, len(self.output_text) - self.stop_hold)]
