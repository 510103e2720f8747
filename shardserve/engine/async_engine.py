"""The engine behind the API server: LLMEngine's step loop in its own thread, per-request output
streams for asyncio.

Why a thread: a step is seconds of blocking compute on a CPU and never yields, so running it on the
event loop would stall every HTTP connection. The loop thread alone touches the engine; the event
loop hands it commands (add, abort) through a queue and gets outputs back through
`loop.call_soon_threadsafe`, so no engine lock is ever held across a step. Tokenization and chat
templating happen before a request reaches here (in worker threads of the server).

If a step raises (a worker died, a collective timed out), the engine is dead: every open stream
gets the error, new requests are refused, and `is_alive()` turns /health to 503.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable

from shardserve.engine.engine import EngineStats, PromptType
from shardserve.outputs import RequestOutput
from shardserve.sampling_params import SamplingParams

logger = logging.getLogger("shardserve")

HEALTH_CHECK_INTERVAL_S = 1.0


class EngineDeadError(RuntimeError):
    pass


class RequestStream:
    """One request's outputs, delivered by the engine thread."""

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.request_id, self.loop = engine, request_id, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise EngineDeadError(f"the engine stopped: {item}") from item
        self.finished = item.finished
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._commands.put((self.engine._abort, (self.request_id,), None))


class AsyncLLMEngine:
    def __init__(self, engine: Any) -> None:
        """engine: an LLMEngine or a DataParallelEngine, used from the loop thread only."""
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardserve-engine", daemon=True)
        self._thread.start()

    # ---- state -----------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    def is_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def stats(self) -> EngineStats:
        # Called from the event loop while the loop thread steps: it only reads lengths and
        # counters, so the worst a race gives is a value one step old.
        return self.engine.stats()

    # ---- requests --------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None, priority: int = 0) -> RequestStream:
        """Queue a request; returns once the engine has accepted it (a bad request raises here).
        Iterate the stream for cumulative outputs; `aclose()` before the end aborts the request
        and frees its KV blocks."""
        loop = asyncio.get_running_loop()
        if params.structured_outputs is not None:   # compiled here, in a pool thread: never on the engine loop
            await loop.run_in_executor(None, self.engine.compile_structured, params)
        stream = RequestStream(self, request_id, loop)
        try:
            await self._call(loop, self._add, request_id, prompt, params, arrival_time or time.monotonic(), priority,
                             stream)
        except BaseException:   # includes a caller cancelled while the add was pending
            self._commands.put((self._abort, (request_id,), None))
            raise
        return stream

    async def _call(self, loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> Any:
        if not self.is_alive():
            raise EngineDeadError(f"the engine is not running: {self._error}")
        future = loop.create_future()
        self._commands.put((fn, args, future))
        return await future

    def _add(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival: float, priority: int,
             stream: RequestStream) -> None:
        self.engine.add_request(request_id, prompt, params, arrival_time=arrival, priority=priority)
        self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    async def start_profile(self) -> None:
        await self._call(asyncio.get_running_loop(), self._profile, "start_profile")

    async def stop_profile(self) -> list[str]:
        """The trace files written, one per worker."""
        return await self._call(asyncio.get_running_loop(), self._profile, "stop_profile")

    def _profile(self, method: str):
        # Workers answer RPCs in order after their steps, so the steps in flight finish first
        # (their outputs go out as usual); the next loop iteration submits again.
        self._deliver(self.engine.finish_in_flight())
        return getattr(self.engine, method)()

    # ---- the loop thread -------------------------------------------------------------------
    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, args, future = item
            try:
                result, error = fn(*args), None
            except Exception as e:   # a bad request: its caller gets the error, the engine goes on
                result, error = None, e
            if future is not None:
                future.get_loop().call_soon_threadsafe(_settle, future, result, error)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            next_check = time.monotonic()
            while not self._stopping.is_set():
                self._run_commands(block=not self.engine.has_unfinished_requests())
                if not self.engine.has_unfinished_requests():
                    if time.monotonic() >= next_check:   # an idle engine still notices a dead worker
                        self.engine.check_health()
                        next_check = time.monotonic() + HEALTH_CHECK_INTERVAL_S
                    continue
                self._deliver(self.engine.step())
        except BaseException as e:   # the engine is unusable now: tell every waiter, keep the reason
            logger.exception("engine loop died")
            self._error = e
            for stream in self._streams.values():
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)
            self._streams.clear()
        finally:
            self._fail_pending_commands()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One hand-over per event loop per step: each call_soon_threadsafe takes a lock and wakes
        # the loop through its self-pipe, ~6 us apiece, which a step of 256 streams paid 256 times.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_pending_commands(self) -> None:
        reason = EngineDeadError(f"the engine is not running: {self._error or 'shut down'}")
        while True:
            try:
                _, _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                future.get_loop().call_soon_threadsafe(_settle, future, None, reason)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)
        self.engine.shutdown()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:   # in the streams' loop, in the engine's order
        q.put_nowait(out)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():   # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
