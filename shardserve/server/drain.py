"""Graceful drain for rolling updates: on SIGTERM (or Ctrl-C) the server keeps its socket open but
answers every new request 503 (so /health, the readiness probe, fails and load balancers move
away), lets the requests already in flight finish for up to --shutdown-timeout seconds, then
stops. /ping (the liveness probe) and /metrics keep answering while draining, so the kubelet does
not kill a pod that is finishing its work and Prometheus sees it drain. A second signal stops at once.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

import uvicorn

from shardserve.server.protocol import error_body

logger = logging.getLogger("shardserve")

OPEN_WHILE_DRAINING = ("/ping", "/metrics")
_BODY = json.dumps(error_body(503, "the server is shutting down; retry on another replica")).encode()


class DrainGate:
    """ASGI middleware counting the HTTP requests in flight and refusing new ones once draining."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.in_flight = 0
        self.deadline: float | None = None   # monotonic time the drain gives up; None: not draining

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.draining and scope["path"] not in OPEN_WHILE_DRAINING:
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                    (b"content-length", str(len(_BODY)).encode())]})
            await send({"type": "http.response.body", "body": _BODY})
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain in front of its own shutdown: the first signal starts the
    drain; the main loop ends once nothing is in flight or the drain's time is up."""

    def __init__(self, config: uvicorn.Config, gate: DrainGate, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.gate = gate
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.gate.draining:   # second signal: stop now
            self.should_exit = self.force_exit = True
            return
        self.gate.deadline = time.monotonic() + self.shutdown_timeout
        logger.info("draining: new requests get 503, %d in flight get up to %.0f s to finish",
                    self.gate.in_flight, self.shutdown_timeout)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        deadline = self.gate.deadline
        if deadline is None:
            return False
        if self.gate.in_flight == 0:
            logger.info("drained: no request in flight, shutting down")
            return True
        if time.monotonic() >= deadline:
            logger.warning("drain timed out with %d requests in flight; stopping them", self.gate.in_flight)
            return True
        return False
