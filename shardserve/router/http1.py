"""A small HTTP/1.1 client for the router's hot path: non-streaming POSTs to plain-http backends over
kept-alive connections, parsed by httptools (the parser uvicorn uses). aiohttp's general machinery
(timeouts objects, stream readers, cookie jars, tracing hooks) was a third of the router's CPU per
proxied request; this is the part of it a JSON round trip needs. TLS and streams stay on aiohttp.
"""
from __future__ import annotations

import asyncio
import functools
from collections import defaultdict, deque
from urllib.parse import urlsplit

import httptools


class ConnectionFailed(Exception):
    """The request may not have reached the backend: refused, reset, or closed before any answer."""


class _Exchange(asyncio.Protocol):
    """One connection; one request at a time. Keeps the parsed response of the current request."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.content_type, self.body, self.got_bytes = 0, "application/json", [], False

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._finish(ConnectionFailed(f"unparseable HTTP response: {e}"))

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._finish(ConnectionFailed("connection closed before the response ended"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not self.parser.should_keep_alive():
            self.closed = True
            self.transport.close()
        self._finish(None)

    def _finish(self, error: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(error) if error else self.done.set_result(None)


class Http1Pool:
    """Idle connections per (host, port); a request takes one (or opens one) and gives it back."""

    def __init__(self) -> None:
        self.idle: dict[tuple[str, int], deque[_Exchange]] = defaultdict(deque)

    async def post(self, url: str, body: bytes, headers: dict[str, str], timeout: float) -> tuple[int, bytes, str]:
        """(status, body, content type). Raises ConnectionFailed or asyncio.TimeoutError."""
        key, start = _request_start(url)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = f"{start}Content-Length: {len(body)}\r\n{head}\r\n".encode("latin-1") + body
        idle = self.idle[key]
        while idle:   # a kept-alive connection the server dropped meanwhile fails before any byte: next one
            conn = idle.pop()
            if conn.closed:
                continue
            try:
                return await self._exchange(conn, request, key, timeout)
            except ConnectionFailed:
                if conn.got_bytes:
                    raise
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Exchange, *key), timeout)
        except OSError as e:
            raise ConnectionFailed(f"{type(e).__name__}: {e}") from None
        return await self._exchange(conn, request, key, timeout)

    async def _exchange(self, conn: _Exchange, request: bytes, key: tuple[str, int],
                        timeout: float) -> tuple[int, bytes, str]:
        conn._reset()
        loop = asyncio.get_running_loop()
        conn.done = done = loop.create_future()
        conn.transport.write(request)
        # A timer on the future rather than asyncio.wait_for, which wraps it in more machinery per call.
        timer = loop.call_later(timeout, lambda: done.done() or done.set_exception(asyncio.TimeoutError()))
        try:
            await done
        except BaseException:   # timeout or cancellation: the connection is mid-response, drop it
            conn.transport.close()
            raise
        finally:
            timer.cancel()
        if not conn.closed:
            self.idle[key].append(conn)
        return conn.status, b"".join(conn.body), conn.content_type

    def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.transport.close()
        self.idle.clear()


@functools.lru_cache(maxsize=256)
def _request_start(url: str) -> tuple[tuple[str, int], str]:
    """(host, port) and the request line plus fixed headers for a POST to url; parsed once per url."""
    parts = urlsplit(url)
    start = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
             "Content-Type: application/json\r\n")
    return (parts.hostname or "localhost", parts.port or 80), start
