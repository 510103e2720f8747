"""HTTP clients for the router's backends: endpoint choice by weight among healthy ones, a bounded
retry on another endpoint for connection errors and 5xx, per-call timeouts, background health
checks, and one error type that says which backend failed and how."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import Any, AsyncIterator

import httpx

from shardserve.router.config import Backend, Endpoint, RouterConfig

logger = logging.getLogger("shardserve.router")

HEALTH_INTERVAL_S = 5.0
MAX_ATTEMPTS = 2   # the first endpoint, then one other


class BackendError(Exception):
    def __init__(self, backend: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{backend}: {message}")
        self.backend, self.message, self.status = backend, message, status


class BackendPool:
    def __init__(self, config: RouterConfig) -> None:
        self.backends = config.backends
        self.client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=1000,
                                                                          max_keepalive_connections=100))
        self.healthy: dict[str, bool] = {e.base_url: True for b in self.backends.values() for e in b.endpoints}
        self._task: asyncio.Task | None = None
        self.latency_observer = None   # set by the app: (backend id, seconds) -> None

    # ---- health ----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def check_health(self) -> None:
        async def probe(endpoint: Endpoint) -> None:
            try:
                r = await self.client.get(endpoint.base_url + "/models", headers=_auth(endpoint), timeout=3.0)
                ok = r.status_code < 500
            except httpx.HTTPError:
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
    def _request_body(self, backend: Backend, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "model": backend.model}

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
                       timeout: float | None = None) -> httpx.Response:
        """The backend's response as it came (4xx included, for pass-through); connection errors
        and 5xx are retried on another endpoint, then raised as BackendError."""
        backend = self.backends[backend_id]
        timeout = timeout or backend.timeout_s
        last: BackendError | None = None
        for endpoint in self._order(backend)[:MAX_ATTEMPTS]:
            start = time.perf_counter()
            try:
                r = await self.client.post(endpoint.base_url + "/chat/completions", json=self._request_body(
                    backend, {**body, "stream": False}), headers={**_auth(endpoint), **(headers or {})},
                    timeout=timeout)
            except httpx.TimeoutException:
                raise BackendError(backend_id, f"timed out after {timeout:g} s") from None
            except httpx.TransportError as e:   # connection refused / reset: try another endpoint
                self.healthy[endpoint.base_url] = False
                last = BackendError(backend_id, f"cannot connect to {endpoint.base_url}: {type(e).__name__}")
                continue
            self._observe(backend_id, time.perf_counter() - start)
            if r.status_code >= 500:
                last = BackendError(backend_id, f"HTTP {r.status_code}: {r.text[:200]}", r.status_code)
                continue
            return r
        raise last or BackendError(backend_id, "no endpoints")

    async def chat_stream(self, backend_id: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                          timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """Streamed chunks (parsed SSE events) from one backend. Connection and HTTP errors are
        raised before the first chunk, when another endpoint can still be tried."""
        backend = self.backends[backend_id]
        timeout = timeout or backend.timeout_s
        last: BackendError | None = None
        for endpoint in self._order(backend)[:MAX_ATTEMPTS]:
            request = self.client.build_request(
                "POST", endpoint.base_url + "/chat/completions",
                json=self._request_body(backend, {**body, "stream": True}),
                headers={**_auth(endpoint), **(headers or {})},
                timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)))
            try:
                response = await self.client.send(request, stream=True)
            except httpx.TimeoutException:
                raise BackendError(backend_id, f"timed out after {timeout:g} s") from None
            except httpx.TransportError as e:
                self.healthy[endpoint.base_url] = False
                last = BackendError(backend_id, f"cannot connect to {endpoint.base_url}: {type(e).__name__}")
                continue
            if response.status_code >= 400:
                text = (await response.aread()).decode(errors="replace")
                await response.aclose()
                last = BackendError(backend_id, f"HTTP {response.status_code}: {text[:200]}", response.status_code)
                if response.status_code >= 500:
                    continue
                raise last
            return _events(backend_id, response)
        raise last or BackendError(backend_id, "no endpoints")

    def _observe(self, backend_id: str, seconds: float) -> None:
        if self.latency_observer is not None:
            self.latency_observer(backend_id, seconds)


async def _events(backend_id: str, response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    try:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                yield json.loads(data)
            except ValueError:
                raise BackendError(backend_id, f"invalid stream event: {data[:100]!r}") from None
    except httpx.TimeoutException:
        raise BackendError(backend_id, "timed out while streaming") from None
    except httpx.TransportError as e:
        raise BackendError(backend_id, f"stream broke: {type(e).__name__}") from None
    finally:
        await response.aclose()


def _auth(endpoint: Endpoint) -> dict[str, str]:
    return {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}


def _error_message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]
