"""The router's OpenAI-compatible app: pick a route per request (a backend, a static decision or a
fusion panel), call the backends, answer in the chat-completions shape with `x-vsr-*` headers."""
from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

from shardserve.router.backends import BackendError, BackendPool
from shardserve.router.config import FUSION_MODEL, FusionSettings, RouterConfig
from shardserve.router.fusion import DEPTH_HEADER, FusionError, FusionRunner, FusionTrace, add_usage
from shardserve.router.signals import SignalEvaluator
from shardserve.server.api import RequestIdAndAuth
from shardserve.server.openapi import document_bodies
from shardserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from shardserve.server.tracing import forwarded_context

logger = logging.getLogger("shardserve.router")


@dataclass
class Route:
    algorithm: str                      # static | fusion
    decision: str | None
    backend: str | None = None          # static
    fusion: FusionSettings | None = None


class RouterMetrics:
    def __init__(self) -> None:
        disable_created_metrics()   # as the server: no *_created series
        self.registry = reg = CollectorRegistry()
        self.requests = Counter("router_requests", "Routed requests.", ["decision", "algorithm"], registry=reg)
        self.backend_latency = Histogram("router_backend_latency_seconds", "Backend call latency.", ["backend"],
                                         registry=reg, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                                                5, 10, 30, 60, 120))
        self.panel_failures = Counter("router_panel_member_failures", "Fusion panel members that failed.",
                                      ["backend"], registry=reg)
        self.fusion_latency = Histogram("router_fusion_latency_seconds", "Whole fusion requests.", registry=reg,
                                        buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.fusion_requests = Counter("router_fusion_requests", "Fusion requests by outcome (ok, failed).",
                                       ["outcome"], registry=reg)
        self._children: dict[tuple, Any] = {}

    def child(self, metric, *labels: str):
        """metric.labels(*labels), kept: prometheus_client's lookup takes a lock and validates
        the labels on every call, which shows on the router's per-request path."""
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child


def _plugin(body: dict[str, Any]) -> dict[str, Any] | None:
    plugins = body.get("plugins")
    if plugins is None:
        return None
    if not isinstance(plugins, list) or not all(isinstance(p, dict) for p in plugins):
        raise APIError(400, "plugins must be a list of objects", "plugins")
    return next((p for p in plugins if p.get("id") == "fusion"), None)


class Router:
    def __init__(self, config: RouterConfig, evaluator: SignalEvaluator) -> None:
        self.config, self.evaluator = config, evaluator
        self.metrics = RouterMetrics()
        self.pool = BackendPool(config)
        self.pool.latency_observer = lambda b, s: self.metrics.child(self.metrics.backend_latency, b).observe(s)
        self.fusion = FusionRunner(self.pool, lambda b: self.metrics.panel_failures.labels(b).inc())

    def route(self, body: dict[str, Any], static_only: bool = False) -> Route:
        model, messages = body.get("model"), body["messages"]
        plugin = _plugin(body)
        if model not in self.config.model_ids():
            raise APIError(404, f"unknown model {model!r}; this router serves: {', '.join(self.config.model_ids())}",
                           "model")
        if plugin is not None:
            return Route("fusion", "plugin", fusion=self._plugin_settings(plugin, messages))
        if model in self.config.backends:
            return Route("static", None, backend=model)
        fusion_only = model == FUSION_MODEL
        for d in self.config.decisions:
            if (fusion_only and d.algorithm != "fusion") or (static_only and d.algorithm != "static"):
                continue
            if self.evaluator.decision_matches(d, messages):
                return Route(d.algorithm, d.id, backend=d.model, fusion=d.fusion)
        if fusion_only:
            raise APIError(400, "no fusion decision matched this request, so vllm-sr/fusion cannot answer it; "
                                "use vllm-sr/auto, or name the panel with a fusion plugin in the request", "model")
        return Route("static", "default", backend=self.config.default_model)

    def _plugin_settings(self, plugin: dict[str, Any], messages) -> FusionSettings:
        members, judge = plugin.get("analysis_models"), plugin.get("judge_model")
        if not isinstance(members, list) or not members or not all(isinstance(m, str) for m in members):
            raise APIError(400, "the fusion plugin needs analysis_models: a list of backend ids", "plugins")
        unknown = [m for m in members + [judge] if m not in self.config.backends]
        if unknown:
            raise APIError(400, f"the fusion plugin names unknown backends {unknown}; backends: "
                                f"{', '.join(self.config.backends)}", "plugins")
        base = next((d.fusion for d in self.config.decisions if d.fusion is not None
                     and self.evaluator.decision_matches(d, messages)), None)
        if base is None:
            base = next((d.fusion for d in self.config.decisions if d.fusion is not None), None)
        settings = FusionSettings(members, judge)
        if base is not None:   # the decision's knobs (error policy, quorum, timeouts, templates) still apply
            quorum = base.min_successful_responses
            settings = FusionSettings(members, judge, base.max_concurrent, base.on_error,
                                      quorum if quorum is not None and quorum <= len(members) else None,
                                      base.round_timeout_seconds,
                                      {k: v for k, v in base.analysis_overrides.items() if k in members},
                                      base.include_intermediate_responses, base.analysis_template,
                                      base.synthesis_template)
        return settings


def build_router_app(config: RouterConfig, api_key: str | None = None, evaluator: SignalEvaluator | None = None):
    """The router as an ASGI app: the routed POST endpoints as plain ASGI (below), the rest FastAPI."""
    router = Router(config, evaluator or SignalEvaluator())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        router.pool.start()
        try:
            yield
        finally:
            await router.pool.close()

    app = FastAPI(title="shardserve router", lifespan=lifespan)
    app.state.router = router

    @app.get("/v1/models")
    async def models():
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "shardserve-router"} for m in config.models]
        data += [{"id": b.id, "object": "model", "created": 0, "owned_by": b.type, "root": b.model}
                 for b in config.backends.values()]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        return {"status": "ok", "backends": {b.id: {e.base_url: router.pool.healthy.get(e.base_url, True)
                                                    for e in b.endpoints} for b in config.backends.values()}}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(generate_latest(router.metrics.registry), media_type="text/plain; version=0.0.4")

    document_bodies(app, {"/v1/chat/completions": (ChatCompletionRequest, "Route chat completion", True),
                          "/v1/completions": (CompletionRequest, "Route completion", True)})
    return RequestIdAndAuth(RoutedPosts(app, router), api_key=api_key)


class RoutedPosts:
    """POST /v1/chat/completions and /v1/completions as plain ASGI in front of the FastAPI app,
    which keeps the GET endpoints and the lifespan. FastAPI's routing and middleware layers cost
    about as much router CPU per request as the proxying itself (py-spy), and these two paths are
    all of the router's added latency."""

    def __init__(self, app: FastAPI, router: Router) -> None:
        self.app, self.router = app, router
        self.handlers = {"/v1/chat/completions": _chat, "/v1/completions": _completions}

    async def __call__(self, scope, receive, send):
        handler = self.handlers.get(scope.get("path", "")) if scope["type"] == "http" else None
        if handler is None:
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            response = JSONResponse(error_body(405, f"{scope['method']} is not allowed on {scope['path']}; use POST"),
                                    status_code=405, headers={"Allow": "POST"})
            return await response(scope, receive, send)
        depth = next((v for k, v in scope["headers"] if k.lower() == DEPTH_HEADER.encode()), b"0")
        try:
            with forwarded_context(scope["headers"], "router_request", {"http.route": scope["path"]}) as trace:
                response = await handler(self.router, await _json_object(receive), depth, trace)
        except APIError as e:
            response = JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status, headers=e.headers)
        except Exception:   # never a dropped connection: an OpenAI-style 500, the traceback in the log
            logger.exception("unexpected router error")
            response = JSONResponse(error_body(500, "internal router error; see the router's log"), status_code=500)
        await response(scope, receive, send)


async def _chat(router: Router, body: dict[str, Any], depth_header: bytes, trace: dict[str, str]):
    if not isinstance(body.get("messages"), list) or not body["messages"] \
            or not all(isinstance(m, dict) for m in body["messages"]):
        raise APIError(400, "messages: a non-empty list of message objects is required", "messages")
    try:
        depth = int(depth_header)
    except ValueError:
        depth = 0
    route = router.route(body)
    router.metrics.child(router.metrics.requests, route.decision or "none", route.algorithm).inc()
    selected = route.backend if route.algorithm == "static" else route.fusion.judge_model
    headers = {"x-vsr-selected-model": selected, "x-vsr-selected-decision": route.decision or "none",
               "x-vsr-selected-algorithm": route.algorithm}
    if route.algorithm == "static":
        return await _static(router, route, body, headers, trace=trace)
    if depth >= 1:
        raise APIError(400, f"this request is already inside a fusion panel ({DEPTH_HEADER}: {depth}); a panel "
                            "member cannot start another panel")
    return await _fusion(router, route, body, headers, depth, trace)


async def _completions(router: Router, body: dict[str, Any], depth_header: bytes, trace: dict[str, str]):
    """Legacy completions: a backend id passes through; vllm-sr/auto takes static decisions
    (signals see the prompt as a user message) or the default. Panels answer chats only."""
    prompt = body.get("prompt")
    if not isinstance(prompt, (str, list)) or not prompt:
        raise APIError(400, "prompt: a non-empty string or list is required", "prompt")
    if body.get("model") == FUSION_MODEL or _plugin(body) is not None:
        raise APIError(400, "fusion panels answer /v1/chat/completions only", "model")
    text = prompt if isinstance(prompt, str) else " ".join(p for p in prompt if isinstance(p, str))
    route = router.route({**body, "messages": [{"role": "user", "content": text}]}, static_only=True)
    router.metrics.child(router.metrics.requests, route.decision or "none", route.algorithm).inc()
    headers = {"x-vsr-selected-model": route.backend, "x-vsr-selected-decision": route.decision or "none",
               "x-vsr-selected-algorithm": route.algorithm}
    return await _static(router, route, body, headers, path="/completions", trace=trace)


async def _json_object(receive) -> dict[str, Any]:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(400, "the client disconnected before sending the whole body")
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


class _RawReply:
    """A whole non-streaming answer as the two ASGI messages it is (starlette's Response takes more
    steps to the same messages, on every relayed request)."""

    def __init__(self, status: int, body: bytes, content_type: str, headers: dict[str, str]) -> None:
        self.status, self.body = status, body
        self.headers = [(b"content-type", content_type.encode("latin-1")), (b"content-length", b"%d" % len(body)),
                        *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def _backend_error(e: BackendError) -> APIError:
    status = e.status if e.status is not None and 400 <= e.status < 500 else 502
    return APIError(status, f"backend {e.backend} failed: {e.message}")


def _sse(payload: Any) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _static(router: Router, route: Route, body: dict[str, Any], headers: dict[str, str],
                  path: str = "/chat/completions", trace: dict[str, str] | None = None):
    forward = {k: v for k, v in body.items() if k != "plugins"}
    try:
        if not body.get("stream"):   # relayed as bytes: no re-parsing on the hot path
            r = await router.pool.chat_raw(route.backend, forward, trace, path=path)
            if not r.content.lstrip()[:1] == b"{":   # a cheap sanity check, not a full parse
                raise BackendError(route.backend, f"invalid response (not JSON): {r.content[:100]!r}")
            return _RawReply(r.status_code, r.content, r.content_type, headers)
        events = await router.pool.chat_stream(route.backend, forward, trace, path=path)
    except BackendError as e:
        raise _backend_error(e) from e

    async def relay() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield _sse(event)
        except BackendError as e:
            yield _sse(error_body(502, str(e)))
        yield _sse("[DONE]")
    return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)


async def _fusion(router: Router, route: Route, body: dict[str, Any], headers: dict[str, str], depth: int,
                  trace: dict[str, str]):
    settings, runner = route.fusion, router.fusion
    inner = {**trace, DEPTH_HEADER: str(depth + 1)}   # trace context goes to every backend call
    trace = FusionTrace(route.decision, settings.judge_model)
    usage: dict[str, int] = {}
    start = time.perf_counter()
    try:
        await runner.run_panel(settings, body, inner, trace)
        for r in trace.panel_results:
            add_usage(usage, r.usage)
        await runner.analyse(settings, body, inner, trace, usage)
        final = runner.synthesis_body(settings, body, trace)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.get("model")}
        trace_dict = trace.as_dict(settings.include_intermediate_responses)
        if not body.get("stream"):
            data = await router.pool.chat(settings.judge_model, final, inner)
            add_usage(usage, data.get("usage"))
            router.metrics.fusion_latency.observe(time.perf_counter() - start)
            router.metrics.fusion_requests.labels("ok").inc()
            return JSONResponse({**data, **meta, "object": "chat.completion", "usage": usage,
                                 "fusion_trace": trace_dict}, headers=headers)
        want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = await router.pool.chat_stream(settings.judge_model,
                                               {**final, "stream_options": {"include_usage": True}}, inner)
    except FusionError as e:
        router.metrics.fusion_requests.labels("failed").inc()
        raise APIError(502, f"fusion failed: {e}") from e
    except BackendError as e:
        router.metrics.fusion_requests.labels("failed").inc()
        raise APIError(502, f"fusion judge {e.backend} failed: {e.message}") from e

    async def synthesis() -> AsyncIterator[str]:
        first = True
        try:
            async for event in events:
                if event.get("usage") and not event.get("choices"):
                    add_usage(usage, event["usage"])
                    continue
                event.pop("usage", None)
                event.update(meta)
                if first:   # the trace rides on the first chunk
                    event["fusion_trace"], first = trace_dict, False
                yield _sse(event)
        except BackendError as e:
            router.metrics.fusion_requests.labels("failed").inc()
            yield _sse(error_body(502, f"fusion judge failed while streaming: {e}"))
        else:
            router.metrics.fusion_requests.labels("ok").inc()
        if want_usage:
            yield _sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        router.metrics.fusion_latency.observe(time.perf_counter() - start)
        yield _sse("[DONE]")
    return StreamingResponse(synthesis(), media_type="text/event-stream", headers=headers)
