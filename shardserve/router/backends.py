"""HTTP clients for the router's backends: endpoint choice by weight among healthy ones, a bounded
retry on another endpoint for connection errors and 5xx, per-call timeouts, background health
checks, and one error type that says which backend failed and how."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp

from shardserve.router.config import Backend, Endpoint, RouterConfig
from shardserve.router.http1 import ConnectionFailed, Http1Pool
from shardserve.server.protocol import sse_data

logger = logging.getLogger("shardserve.router")

HEALTH_INTERVAL_S = 5.0
MAX_ATTEMPTS = 2   # the first endpoint, then one other


class BackendError(Exception):
    def __init__(self, backend: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{backend}: {message}")
        self.backend, self.message, self.status = backend, message, status


@dataclass
class RawResponse:
    status_code: int
    content: bytes
    content_type: str

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class BackendPool:
    """Non-streaming calls to plain-http endpoints go through the lean client in http1.py; streams,
    TLS and health checks through aiohttp."""

    def __init__(self, config: RouterConfig) -> None:
        self.backends = config.backends
        self.session: aiohttp.ClientSession | None = None
        self.healthy: dict[str, bool] = {e.base_url: True for b in self.backends.values() for e in b.endpoints}
        self.http1 = Http1Pool()
        self._task: asyncio.Task | None = None
        self.latency_observer = None   # set by the app: (backend id, seconds) -> None

    # ---- health ----------------------------------------------------------------------------
    def start(self) -> None:
        """Inside the event loop: open the connection pool and start health checks."""
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000),
                                             timeout=aiohttp.ClientTimeout(total=None))
        self._task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        self.http1.close()

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def check_health(self) -> None:
        async def probe(endpoint: Endpoint) -> None:
            try:
                async with self.session.get(endpoint.base_url + "/models", headers=_auth(endpoint),
                                            timeout=aiohttp.ClientTimeout(total=3.0)) as r:
                    ok = r.status < 500
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            if ok != self.healthy.get(endpoint.base_url):
                logger.info("backend endpoint %s is %s", endpoint.base_url, "healthy" if ok else "unhealthy")
            self.healthy[endpoint.base_url] = ok
        await asyncio.gather(*(probe(e) for b in self.backends.values() for e in b.endpoints))

    def _order(self, backend: Backend) -> list[Endpoint]:
        """Healthy endpoints first, each group in a weighted random order."""
        def weighted(endpoints: list[Endpoint]) -> list[Endpoint]:
            return sorted(endpoints, key=lambda e: -random.random() ** (1.0 / e.weight))
        healthy = [e for e in backend.endpoints if self.healthy.get(e.base_url, True)]
        return weighted(healthy) + weighted([e for e in backend.endpoints if e not in healthy])

    # ---- calls -----------------------------------------------------------------------------
    async def chat(self, backend_id: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        """A non-streaming chat completion from one backend, as parsed JSON."""
        r = await self.chat_raw(backend_id, body, headers, timeout)
        if r.status_code >= 400:
            raise BackendError(backend_id, f"HTTP {r.status_code}: {_error_message(r)}", r.status_code)
        try:
            data = r.json()
            data["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise BackendError(backend_id, f"invalid response (not a chat completion): {r.text[:100]!r}") from None
        return data

    async def chat_raw(self, backend_id: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                       timeout: float | None = None, path: str = "/chat/completions") -> RawResponse:
        """The backend's response as it came (4xx included, for pass-through); connection errors
        and 5xx are retried on another endpoint, then raised as BackendError."""
        backend = self.backends[backend_id]
        timeout = timeout or backend.timeout_s
        payload = {**body, "model": backend.model, "stream": False}
        last: BackendError | None = None
        for endpoint in self._order(backend)[:MAX_ATTEMPTS]:
            start = time.perf_counter()
            try:
                raw = await self._post(endpoint, path, payload, headers, timeout)
            except asyncio.TimeoutError:
                raise BackendError(backend_id, f"timed out after {timeout:g} s") from None
            except (aiohttp.ClientError, ConnectionFailed) as e:   # refused / reset: try another endpoint
                self.healthy[endpoint.base_url] = False
                last = BackendError(backend_id, f"cannot connect to {endpoint.base_url}: {type(e).__name__}")
                continue
            self._observe(backend_id, time.perf_counter() - start)
            if raw.status_code >= 500:
                last = BackendError(backend_id, f"HTTP {raw.status_code}: {raw.text[:200]}", raw.status_code)
                continue
            return raw
        raise last or BackendError(backend_id, "no endpoints")

    async def chat_stream(self, backend_id: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                          timeout: float | None = None, path: str = "/chat/completions"
                          ) -> AsyncIterator[dict[str, Any]]:
        """Streamed chunks (parsed SSE events) from one backend. Connection and HTTP errors are
        raised before the first chunk, when another endpoint can still be tried."""
        backend = self.backends[backend_id]
        timeout = timeout or backend.timeout_s
        payload = {**body, "model": backend.model, "stream": True}
        last: BackendError | None = None
        for endpoint in self._order(backend)[:MAX_ATTEMPTS]:
            try:
                response = await self.session.post(
                    endpoint.base_url + path, json=payload,
                    headers={**_auth(endpoint), **(headers or {})},
                    timeout=aiohttp.ClientTimeout(total=None, connect=min(timeout, 10.0), sock_read=timeout))
            except asyncio.TimeoutError:
                raise BackendError(backend_id, f"timed out after {timeout:g} s") from None
            except aiohttp.ClientError as e:
                self.healthy[endpoint.base_url] = False
                last = BackendError(backend_id, f"cannot connect to {endpoint.base_url}: {type(e).__name__}")
                continue
            if response.status >= 400:
                text = (await response.read()).decode(errors="replace")
                response.release()
                last = BackendError(backend_id, f"HTTP {response.status}: {text[:200]}", response.status)
                if response.status >= 500:
                    continue
                raise last
            return _events(backend_id, response)
        raise last or BackendError(backend_id, "no endpoints")

    async def _post(self, endpoint: Endpoint, path: str, payload: dict[str, Any], headers: dict[str, str] | None,
                    timeout: float) -> RawResponse:
        all_headers = {**_auth(endpoint), **(headers or {})}
        if endpoint.base_url.startswith("http://"):   # the lean client; TLS goes through aiohttp
            status, content, content_type = await self.http1.post(
                endpoint.base_url + path, json.dumps(payload).encode(), all_headers, timeout)
            return RawResponse(status, content, content_type)
        async with self.session.post(endpoint.base_url + path, json=payload, headers=all_headers,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return RawResponse(r.status, await r.read(), r.headers.get("Content-Type", "application/json"))

    def _observe(self, backend_id: str, seconds: float) -> None:
        if self.latency_observer is not None:
            self.latency_observer(backend_id, seconds)


async def _events(backend_id: str, response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    # A backend that dies mid-stream may just close the connection (a close-delimited body ends
    # cleanly): only `data: [DONE]` tells a finished stream from a cut one.
    done = False

    async def lines() -> AsyncIterator[bytes]:
        nonlocal done
        async for raw in response.content:
            line = raw.strip()
            done = done or (line.startswith(b"data:") and line[5:].strip() == b"[DONE]")
            yield raw

    try:
        async for data in sse_data(lines()):
            try:
                yield json.loads(data)
            except ValueError:
                raise BackendError(backend_id, f"invalid stream event: {data[:100]!r}") from None
        if not done:
            raise BackendError(backend_id, "the stream ended before data: [DONE] (the backend went away)")
    except asyncio.TimeoutError:
        raise BackendError(backend_id, "timed out while streaming") from None
    except aiohttp.ClientError as e:
        raise BackendError(backend_id, f"stream broke: {type(e).__name__}") from None
    finally:
        response.release()


def _auth(endpoint: Endpoint) -> dict[str, str]:
    return {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}


def _error_message(r: RawResponse) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]
