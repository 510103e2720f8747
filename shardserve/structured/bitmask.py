"""The worker side of structured outputs: one xgrammar GrammarMatcher per constrained request, kept
by the worker that samples (TP rank 0 of the last pipeline stage), and the per-step token bitmask.

Order within a step: `mask_logits` first advances every matcher by the tokens the previous step
sampled (with async scheduling those may still be on their way to the host: it waits for that step
only, while this step's forward runs on the device), then fills one bitmask row per constrained
request and applies it to the logits before the sampler sees them (before penalties, temperature,
top-k/top-p). `record` keeps the step's sampled tokens for the next step. A matcher that accepted a
stop token is terminated: its request stops on that token (EOS) as any other would.

With speculative decoding a request's rows verify its drafts one after another: row j is masked by
the grammar's state after drafts 1..j, so the matcher takes the drafts while the rows are filled
and rolls them back after (a draft the grammar refuses ends its rows: the rejection sampler can
never accept it, since its row gives it probability 0)."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)


class GrammarBitmask:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.matchers: dict[str, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None   # host rows, grown to the largest batch seen
        self._pending: tuple[list[str], torch.Tensor, Any] | None = None   # (req ids, tokens, event)
        self._copied: Any = None   # CUDA: the event after the last copy out of the pinned host rows
        self._batch: Any = None   # xgrammar's batch matcher, made with the first grammar

    def _xgr(self):
        """xgrammar, imported with the first constrained request: a server that never gets one (or a
        machine without the package, such as the GPU test hosts) does not need it."""
        import xgrammar as xgr
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=_fill_threads())
        return xgr

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.matchers.pop(req_id, None)

    def _matcher(self, state: Any) -> xgr.GrammarMatcher:
        matcher = self.matchers.get(state.req_id)
        if matcher is None:   # new, or resumed after preemption: replay the outputs it already has
            spec = state.sampling_params.structured_outputs
            if spec.compiled is None:
                raise RuntimeError(f"request {state.req_id} reached the worker without a compiled grammar")
            matcher = self.matchers[state.req_id] = spec.compiled.matcher()
            for token in state.token_ids[state.num_prompt_tokens:]:
                matcher.accept_token(token)
        return matcher

    def _accept_pending(self) -> None:
        if self._pending is None:
            return
        req_ids, tokens, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        for req_id, request_tokens in zip(req_ids, tokens if isinstance(tokens, list) else tokens.tolist()):
            matcher = self.matchers.get(req_id)
            for token in request_tokens if isinstance(request_tokens, list) else [request_tokens]:
                if matcher is not None and not matcher.is_terminated() and not matcher.accept_token(token):
                    logger.warning("request %s: the grammar rejected sampled token %d", req_id, token)

    def mask_logits(self, logits: torch.Tensor, states: list[Any],
                    drafts: list[list[int]] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Rows of `states` with a grammar get their disallowed tokens set to -inf. Returns the logits
        (float32 where the host kernel needs it) and the constrained rows. With drafts (one list per
        request, `states` holding a request's state once per row: len(drafts[i]) + 1 rows), each
        row is masked for the grammar's state after the drafts before it."""
        self._accept_pending()
        rows = [i for i, s in enumerate(states) if s.sampling_params.structured_outputs is not None]
        if not rows:
            return logits, rows
        if drafts is not None:
            return self._mask_draft_rows(logits, states, drafts), rows
        bitmask = self._host_rows(len(states))
        live, matchers = [], []
        for row in rows:
            matcher = self._matcher(states[row])
            if not matcher.is_terminated():   # a terminated one's token is dropped by the scheduler
                live.append(row)
                matchers.append(matcher)
        if not live:
            return logits, rows
        if len(live) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, live[0])
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, live)
        return self._apply(logits, bitmask, live), rows

    def _host_rows(self, num_rows: int) -> torch.Tensor:
        xgr = self._xgr()
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
            if self.device.type == "cuda":
                self._bitmask = self._bitmask.pin_memory()
        if self._copied is not None:   # the previous copy has left the host rows we refill
            self._copied.synchronize()
            self._copied = None
        return self._bitmask[:num_rows, :(self.vocab_size + 31) // 32]

    def _mask_draft_rows(self, logits: torch.Tensor, states: list[Any], drafts: list[list[int]]) -> torch.Tensor:
        bitmask = self._host_rows(len(states))
        live, start = [], 0
        for request_drafts in drafts:
            state = states[start]
            if state.sampling_params.structured_outputs is not None:
                matcher = self._matcher(state)
                taken = 0
                for j in range(len(request_drafts) + 1):
                    if matcher.is_terminated():
                        break
                    matcher.fill_next_token_bitmask(bitmask, start + j)
                    live.append(start + j)
                    if j == len(request_drafts) or not matcher.accept_token(request_drafts[j]):
                        break
                    taken += 1
                if taken:
                    matcher.rollback(taken)
            start += len(request_drafts) + 1
        return self._apply(logits, bitmask, live)

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor, live: list[int]) -> torch.Tensor:
        if not live:
            return logits
        if logits.device.type == "cpu" and logits.dtype != torch.float32:
            logits = logits.float()
        mask = bitmask.to(logits.device, non_blocking=True)
        if logits.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._xgr().apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=live)
        return logits

    def record_lists(self, req_ids: list[str], tokens: list[list[int]]) -> None:
        """Like `record`, for a step that verified drafts: each request's accepted tokens, on the host."""
        constrained = [(r, t) for r, t in zip(req_ids, tokens) if r in self.matchers]
        if constrained:
            self._pending = ([r for r, _ in constrained], [t for _, t in constrained], None)

    def record(self, req_ids: list[str], sampled: torch.Tensor, rows: list[int]) -> None:
        """Remember the tokens this step sampled for the constrained rows; the matchers take them
        before the next bitmask is built."""
        if not rows:
            return
        index = torch.tensor(rows, device=sampled.device)
        tokens, event = sampled.index_select(0, index), None
        if tokens.device.type == "cuda":
            tokens = tokens.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._pending = ([req_ids[r] for r in rows], tokens, event)


def _fill_threads() -> int:
    """Threads xgrammar fills a step's bitmask rows with: 1 unless SHARDSERVE_GRAMMAR_THREADS says
    more. Its precomputed masks make a row cost microseconds (32 rows of a JSON schema over a 49K
    vocabulary: 0.015 ms on one thread of a 2-core machine, 0.13-3.4 ms through a pool of 2-8
    threads there; on a 16-core GPU host 1 and 8 threads measured alike). Grammars whose rows need
    many runtime checks (large EBNF, long regexes) may gain from more."""
    value = os.environ.get("SHARDSERVE_GRAMMAR_THREADS", "1")
    try:
        return max(1, int(value))
    except ValueError:
        raise ValueError(f"SHARDSERVE_GRAMMAR_THREADS={value!r} is not a number of threads") from None
