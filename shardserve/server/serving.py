"""What chat and completion requests share: model and length checks, tokenization off the event
loop, running engine requests (several at once, with client-disconnect aborts), SSE framing."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request

from shardserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from shardserve.outputs import RequestOutput
from shardserve.sampling_params import InvalidParameter, SamplingParams
from shardserve.server.metrics import RequestRecord, ServerMetrics
from shardserve.server.protocol import APIError, error_body

DISCONNECT_POLL_S = 0.25


@dataclass
class ServerSettings:
    served_model_name: str   # the first of --served-model-name's names
    max_model_len: int
    max_log_len: int | None = None
    max_queue_len: int | None = None
    chat_template: str | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)   # from --generation-config
    tool_call_parser: str | None = None   # set only with --enable-auto-tool-choice: tool_choice "auto" on
    log_stats: bool = True   # the periodic throughput line (stat_logger.py); --disable-log-stats
    reasoning_parser: str | None = None   # --reasoning-parser: thinking apart from the answer (reasoning.py)
    enable_prompt_tokens_details: bool = False   # usage.prompt_tokens_details.cached_tokens (vLLM's flag)
    return_tokens_as_token_ids: bool = False     # logprobs name tokens `token_id:N` (a request may say too)
    model_aliases: tuple[str, ...] = ()          # --served-model-name's other names, also accepted
    disable_fastapi_docs: bool = False   # no /docs, /redoc, /openapi.json
    root_path: str | None = None         # behind a proxy that strips this prefix
    # CORS, vLLM's defaults (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials)
    cors: dict[str, Any] = field(default_factory=lambda: dict(allow_origins=["*"], allow_methods=["*"],
                                                              allow_headers=["*"], allow_credentials=False))


TokenNamer = Callable[[int, Any], str]   # (token id, its Logprob or None) -> the token as logprobs show it


def token_namer(tokenizer, as_ids: bool) -> TokenNamer:
    """How logprobs name a token: its text (the sampler's decoded token, else decoded here), or
    `token_id:N` (--return-tokens-as-token-ids, vLLM's spelling: exact ids for RL pipelines, where a
    token's text may not map back to it)."""
    if as_ids:
        return lambda token_id, lp: f"token_id:{token_id}"

    def text(token_id: int, lp: Any) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else str(token_id)
    return text


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


class Admissions:
    """Requests past the queue check but not yet in the engine (tokenizing in a thread, or their add
    pending). The engine's waiting count cannot see them, so a burst arriving at once would all pass
    `--max-queue-len`; they count towards it until added to the engine or turned away."""

    def __init__(self) -> None:
        self.count = 0


class Serving:
    def __init__(self, engine: AsyncLLMEngine, settings: ServerSettings, metrics: ServerMetrics,
                 admissions: Admissions | None = None) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.admissions = admissions or Admissions()   # shared by the chat and completion servings
        self._max_prompt_chars: int | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- checks ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        """The name a response carries: the one the request gave, if this server serves it by that
        name (any of --served-model-name's), else its first name."""
        names = (self.settings.served_model_name, *self.settings.model_aliases)
        if model is not None and model not in names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{', '.join(f'`{n}`' for n in names)}.", "model")
        return model or self.settings.served_model_name

    def check_ready(self, raw: Request) -> None:
        """Refuse when the engine is dead or the queue is full, else admit the request: it counts as
        waiting until `release(raw)` (after its engine requests are added, or on any error)."""
        if not self.engine.is_alive():
            raise APIError(503, f"the engine is not running: {self.engine.error}")
        limit = self.settings.max_queue_len
        if limit is not None and self.engine.stats().num_waiting + self.admissions.count >= limit:
            raise APIError(429, f"the server is overloaded: {limit} requests are already waiting "
                                "(--max-queue-len); retry later", headers={"Retry-After": "1"})
        # No await between the check and the count: no other request can slip in between.
        self.admissions.count += 1
        raw.state.admitted = True

    def release(self, raw: Request) -> None:
        """Idempotent: start_all releases once the engine holds the requests; the route again on
        every way out (errors, cancellation when the client goes)."""
        if getattr(raw.state, "admitted", False):
            raw.state.admitted = False
            self.admissions.count -= 1

    def namer(self, req: Any) -> TokenNamer:
        """The request's way of naming tokens in logprobs: its own return_tokens_as_token_ids, else
        the server's."""
        own = req.return_tokens_as_token_ids
        return token_namer(self.tokenizer, self.settings.return_tokens_as_token_ids if own is None else own)

    def cached(self, outs: list[RequestOutput]) -> int | None:
        """Prompt tokens the prefix cache held for these outputs, where usage reports them."""
        return sum(out.num_cached_tokens for out in outs) if self.settings.enable_prompt_tokens_details else None

    def check_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError(400, "this server was started without a tokenizer; send token ids")

    def max_tokens_for(self, prompt_len: int, requested: int | None, param: str) -> int:
        limit = self.settings.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                    f"has {prompt_len} tokens, leaving no room for a completion.", "messages")
            return limit - prompt_len
        if requested < 1:
            raise APIError(400, f"{param} must be at least 1, got {requested}", param)
        if prompt_len + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
                                f"completion). Please reduce the prompt or {param}.", param)
        return requested

    def sampling_params(self, build, *args: Any) -> SamplingParams:
        try:
            return build(*args, defaults=self.settings.sampling_defaults)
        except InvalidParameter as e:
            raise APIError(400, str(e), e.param) from e
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def max_prompt_chars(self) -> int:
        """No prompt longer than this can fit: max_model_len times the longest token's text (an upper
        bound on the characters one token covers). Longer ones are refused before tokenizing."""
        if self._max_prompt_chars is None:
            vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
            self._max_prompt_chars = self.settings.max_model_len * max(map(len, vocab), default=1)
        return self._max_prompt_chars

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_tokenizer()
        if len(text) > self.max_prompt_chars():
            raise APIError(400, f"This model's maximum context length is {self.settings.max_model_len} tokens. "
                                f"However, your prompt has {len(text)} characters, more than any prompt of "
                                f"{self.settings.max_model_len} tokens can hold ({self.max_prompt_chars()}).",
                           "prompt")
        try:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        except ValueError as e:   # text the tokenizer cannot take (a lone surrogate): the client's error
            raise APIError(400, str(e)) from e

    # ---- running ---------------------------------------------------------------------------
    async def _start(self, request_id: str, prompt: dict[str, Any], params: SamplingParams,
                     record: RequestRecord, priority: int) -> AsyncIterator[RequestOutput]:
        """The engine's output stream for one prompt; the request is accepted (or its error raised)
        before this returns, so a bad request never becomes a half-open stream."""
        try:
            stream = await self.engine.add_request(request_id, prompt, params, priority=priority)
        except EngineDeadError as e:
            raise APIError(503, str(e)) from e
        except InvalidParameter as e:
            raise APIError(400, str(e), e.param) from e
        except ValueError as e:
            raise APIError(400, str(e)) from e

        async def outputs() -> AsyncIterator[RequestOutput]:
            try:
                async for out in stream:
                    record.on_output(out)
                    yield out
            finally:
                await stream.aclose()
                last = record.last
                record.finish(last.outputs[0].finish_reason if last is not None and last.finished else "abort")
        return _Closing(outputs(), stream)

    async def start_all(self, raw: Request, prompts: list[dict[str, Any]], params: SamplingParams,
                        req: Any) -> list[AsyncIterator[RequestOutput]]:
        """One engine request per prompt, with the API request's `priority` and `cache_salt`."""
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                suffix = "" if len(prompts) == 1 else f"-{i}"
                rid = raw.state.request_id + suffix
                record = RequestRecord(self.metrics, raw.state.client_request_id + suffix, prompt.get("prompt"),
                                       self.settings.max_log_len, params, raw.headers)
                if req.cache_salt is not None:
                    prompt = {**prompt, "cache_salt": req.cache_salt}
                streams.append(await self._start(rid, prompt, params, record, req.priority))
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        finally:   # added (now in the engine's waiting count) or failed: no longer admitted
            self.release(raw)
        return streams

    @staticmethod
    async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from several streams as they arrive."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in s:
                    await queue.put((i, out, None))
            except BaseException as e:
                await queue.put((i, None, e))
                raise
            finally:
                await queue.put((i, None, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            open_streams = len(streams)
            while open_streams:
                i, out, error = await queue.get()
                if error is not None:
                    raise error
                if out is None:
                    open_streams -= 1
                    continue
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, streams: list[AsyncIterator[RequestOutput]], raw: Request) -> list[RequestOutput]:
        """Final outputs of every stream; a client that disconnects meanwhile aborts them all."""
        async def consume() -> list[RequestOutput]:
            finals: dict[int, RequestOutput] = {}
            async for i, out in self.merged(streams):
                finals[i] = out
            return [finals[i] for i in range(len(streams))]

        task = asyncio.create_task(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await raw.is_disconnected():
                    raise APIError(499, "client disconnected")
        except EngineDeadError as e:
            raise APIError(503, str(e)) from e
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    @staticmethod
    async def sse_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream that fails after its headers went out reports the error as an event, then ends."""
        try:
            async for e in events:
                yield e
        except EngineDeadError as e:
            yield sse(error_body(503, str(e)))
            yield sse("[DONE]")


class _Closing:
    """An output generator whose aclose() aborts the request even if iteration never started
    (an un-started async generator would skip its finally)."""

    def __init__(self, gen: AsyncIterator[RequestOutput], stream) -> None:
        self.gen, self.stream = gen, stream

    def __aiter__(self):
        return self.gen

    async def aclose(self) -> None:
        await self.gen.aclose()
        await self.stream.aclose()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; with cached_tokens (--enable-prompt-tokens-details) the prompt tokens
    the prefix cache held, in prompt_tokens_details."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def now_s() -> int:
    return int(time.time())
