"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + sample."""
from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request

from shardserve.outputs import RequestOutput
from shardserve.server.protocol import APIError, CompletionRequest
from shardserve.server.serving import Serving, TokenNamer, now_s, sse, usage


def _prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(p[0], int):
        return [p]
    return list(p)


class CompletionLogprobs:
    """The legacy completions logprobs block, built incrementally as tokens arrive."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_ids: list[int], entries: list[dict | None], name: TokenNamer, offset: int) -> int:
        for tid, entry in zip(token_ids, entries):
            chosen = entry.get(tid) if entry else None
            text = name(tid, chosen)
            self.tokens.append(text)
            self.token_logprobs.append(None if chosen is None else chosen.logprob)
            self.top_logprobs.append(None if not entry else {name(t, lp): lp.logprob for t, lp in entry.items()})
            self.text_offset.append(offset)
            offset += len(text)
        return offset

    def body(self, start: int = 0) -> dict[str, Any]:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:], "text_offset": self.text_offset[start:]}


class CompletionServing(Serving):
    async def create(self, req: CompletionRequest, raw: Request) -> dict[str, Any] | AsyncIterator[str]:
        model = self.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        self.check_ready(raw)
        prompts = []
        for p in _prompts_of(req):
            ids = await self.encode(p) if isinstance(p, str) else list(p)
            prompts.append({"prompt": p if isinstance(p, str) else None, "prompt_token_ids": ids})
        # One SamplingParams for all prompts: without max_tokens, what the longest prompt leaves.
        longest = max(len(p["prompt_token_ids"]) for p in prompts)
        max_tokens = self.max_tokens_for(longest, req.max_tokens, "max_tokens")
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo and req.logprobs is not None:
            prompt_logprobs = req.logprobs   # echoed prompt tokens carry logprobs too
        params = self.sampling_params(req.sampling_params, max_tokens, req.logprobs, prompt_logprobs)
        request_id = raw.state.request_id
        streams = await self.start_all(raw, prompts, params, req)
        meta = {"id": f"cmpl-{request_id}", "created": now_s(), "model": model}
        if req.stream:
            return self.sse_errors(self._stream(req, streams, meta))
        finals = await self.collect(streams, raw)
        return self._response(req, finals, meta)

    @staticmethod
    def _prompt_logprobs(out: RequestOutput, lp: CompletionLogprobs, name: TokenNamer) -> int:
        entries = [None] + list(out.prompt_logprobs[1:]) if out.prompt_logprobs else [None] * len(out.prompt_token_ids)
        return lp.add(out.prompt_token_ids, entries, name, 0)

    def _response(self, req: CompletionRequest, finals: list[RequestOutput], meta: dict) -> dict[str, Any]:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text, logprobs = c.text, None
                prefix = (out.prompt or "") if req.echo else ""
                if req.logprobs is not None:
                    lp = CompletionLogprobs()
                    name = self.namer(req)
                    offset = self._prompt_logprobs(out, lp, name) if req.echo else 0
                    lp.add(c.token_ids, c.logprobs or [], name, offset)
                    logprobs = lp.body()
                choices.append({"index": i * req.n + c.index, "text": prefix + text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        choices.sort(key=lambda ch: ch["index"])
        return {**meta, "object": "text_completion", "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, self.cached(finals))}

    async def _stream(self, req: CompletionRequest, streams, meta: dict) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        name = self.namer(req)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        prompt_tokens: dict[int, int] = {}
        latest: dict[int, RequestOutput] = {}   # each prompt's (for its cached prompt tokens)
        finished: set[int] = set()

        def chunk(choices: list[dict], extra: dict | None = None) -> str:
            return sse({**meta, "object": "text_completion", "choices": choices, **(extra or {})})

        async for i, out in self.merged(streams):
            prompt_tokens[i], latest[i] = len(out.prompt_token_ids), out
            for c in out.outputs:
                index = i * req.n + c.index
                if index in finished:
                    continue
                first = index not in sent_text
                start_text, start_tok = sent_text.get(index, 0), sent_tokens.get(index, 0)
                delta = c.text[start_text:]
                logprobs = None
                if req.logprobs is not None:
                    lp = CompletionLogprobs()
                    offset = offsets.get(index, 0)
                    if first and req.echo:
                        offset = self._prompt_logprobs(out, lp, name)
                    offsets[index] = lp.add(c.token_ids[start_tok:], (c.logprobs or [])[start_tok:len(c.token_ids)],
                                            name, offset)
                    logprobs = lp.body()
                if first and req.echo:
                    delta = (out.prompt or "") + delta
                if not delta and c.finish_reason is None and not (logprobs and logprobs["tokens"]):
                    continue
                sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                if c.finish_reason is not None:
                    finished.add(index)
                extra = None
                if continuous:
                    extra = {"usage": usage(sum(prompt_tokens.values()), sum(sent_tokens.values()),
                                            self.cached(list(latest.values())))}
                yield chunk([{"index": index, "text": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}], extra)
        if include_usage:
            yield chunk([], {"usage": usage(sum(prompt_tokens.values()), sum(sent_tokens.values()),
                                            self.cached(list(latest.values())))})
        yield sse("[DONE]")
