"""The FastAPI app: OpenAI routes, tokenizer routes, health, metrics; auth and request ids as
middleware; every error in OpenAI's shape."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardserve import __version__
from shardserve.engine.async_engine import AsyncLLMEngine
from shardserve.server.metrics import ServerMetrics
from shardserve.server.openapi import document_bodies
from shardserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from shardserve.server.protocol_responses import ResponsesRequest
from shardserve.server.serving import Admissions, ServerSettings
from shardserve.server.serving_chat import ChatServing
from shardserve.server.serving_completion import CompletionServing
from shardserve.server.serving_responses import ResponsesServing
from shardserve.server.stat_logger import StatLogger, interval_s
from shardserve.worker.profiler import profiler_dir

logger = logging.getLogger("shardserve")

_PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/invocations")
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024   # --max-request-body-bytes (vLLM has no such limit)


def _error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {first.get('msg')}{more}", param


async def _json_body(request: Request, model: type) -> Any:
    """Parse the body ourselves so malformed JSON and schema errors both become 400s with a message."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except Exception as e:   # pydantic.ValidationError
        errors = getattr(e, "errors", lambda: [])()
        raise RequestValidationError(errors) from e


async def _read_limited(receive, limit: int) -> tuple[list[dict], bool]:
    """The request's body messages, read up to `limit` bytes; (messages, too_large)."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, False
        size += len(message.get("body", b""))
        if size > limit:
            return messages, True
        if not message.get("more_body", False):
            return messages, False


class RequestIdAndAuth:
    """Pure ASGI (streams and disconnects pass through untouched): echoes X-Request-Id (the client's
    or a new one), gives each request a fresh engine id, checks the API key on protected paths (in
    constant time), and refuses a body over `max_body_bytes` with 413 before anything parses it."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        client_id = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["client_request_id"] = client_id           # for logs and the response header
        state["request_id"] = uuid.uuid4().hex           # the engine's: unique whatever clients send
        echo = (b"x-request-id", client_id.encode("latin-1"))

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), echo]}
            await send(message)

        if self.api_key is not None and scope["path"].startswith(_PROTECTED):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                response = _error(401, "invalid or missing API key: send 'Authorization: Bearer <key>'")
                return await response(scope, receive, send_with_id)
        limit = self.max_body_bytes
        if limit is not None and scope.get("method") in ("POST", "PUT", "PATCH"):
            too_large = _error(413, f"the request body is larger than {limit} bytes (--max-request-body-bytes)")
            length = headers.get(b"content-length", b"")
            if length.isdigit() and int(length) > limit:
                return await too_large(scope, receive, send_with_id)
            # No (or a lying) Content-Length: count what arrives; the app then replays the buffered body.
            messages, over = await _read_limited(receive, limit)
            if over:
                return await too_large(scope, receive, send_with_id)
            upstream = receive

            async def receive():
                return messages.pop(0) if messages else await upstream()
        await self.app(scope, receive, send_with_id)


def build_app(engine: AsyncLLMEngine, settings: ServerSettings, api_key: str | None = None,
              max_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    metrics = ServerMetrics(engine.stats, settings.served_model_name, engine.config.cache_config)
    if settings.log_stats:
        metrics.stat_logger = StatLogger(engine.stats, interval_s())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(metrics.stat_logger.run()) if metrics.stat_logger is not None else None
        yield
        if task is not None:
            task.cancel()

    docs = not settings.disable_fastapi_docs
    app = FastAPI(title="shardserve", version=__version__, lifespan=lifespan, root_path=settings.root_path or "",
                  openapi_url="/openapi.json" if docs else None, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None)
    metrics.observe_steps(engine)
    admissions = Admissions()   # one queue count for every generating route
    completions = CompletionServing(engine, settings, metrics, admissions)
    chats = ChatServing(engine, settings, metrics, admissions)
    responses = ResponsesServing(engine, settings, metrics, admissions)
    app.state.engine, app.state.settings, app.state.metrics = engine, settings, metrics
    app.add_middleware(RequestIdAndAuth, api_key=api_key, max_body_bytes=max_body_bytes)
    # Outermost: a browser's preflight (OPTIONS, no credentials) is answered before the API key check.
    app.add_middleware(CORSMiddleware, **settings.cors)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))   # 405: Allow

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    def respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def generate(serving, body_model: type, request: Request):
        try:
            return respond(await serving.create(await _json_body(request, body_model), request))
        finally:   # a request refused or failed before reaching the engine leaves the queue count
            serving.release(request)

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        return await generate(completions, CompletionRequest, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        return await generate(chats, ChatCompletionRequest, request)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await generate(responses, ResponsesRequest, request)

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker's one route, as vLLM has it: a body with `messages` is a chat completion, one
        with `prompt` a completion."""
        raw = await request.body()   # kept by starlette: _json_body reads it again
        try:
            keys = json.loads(raw).keys()
        except (ValueError, UnicodeDecodeError, AttributeError):
            keys = ()   # _json_body names what is wrong with it
        if keys and "messages" not in keys and "prompt" not in keys:
            raise APIError(400, "/invocations takes a chat completion (messages) or a completion (prompt) body")
        if "messages" in keys:
            return await generate(chats, ChatCompletionRequest, request)
        return await generate(completions, CompletionRequest, request)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "shardserve",
            "root": engine.config.model_config.model, "max_model_len": settings.max_model_len}
            for name in (settings.served_model_name, *settings.model_aliases)]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await _json_body(request, TokenizeRequest)
        chats.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            _, ids = await chats.render(req.messages, req.add_generation_prompt, False, None, req.chat_template_kwargs)
        else:
            ids = await chats.encode(req.prompt, req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": settings.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await _json_body(request, DetokenizeRequest)
        chats.check_model(req.model)
        chats.check_tokenizer()
        vocab = engine.config.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens, False)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.api_route("/ping", methods=["GET", "POST"], response_class=Response)
    async def ping():
        return Response(status_code=200 if engine.is_alive() else 503)

    @app.get("/health", response_class=Response)
    async def health():
        if engine.is_alive():
            return Response(status_code=200)
        return _error(503, f"the engine is not running: {engine.error}")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    document_bodies(app, {
        "/v1/completions": (CompletionRequest, "Create completion", True),
        "/v1/chat/completions": (ChatCompletionRequest, "Create chat completion", True),
        "/v1/responses": (ResponsesRequest, "Create response", True),
        "/tokenize": (TokenizeRequest, "Tokenize", False),
        "/detokenize": (DetokenizeRequest, "Detokenize", False)})

    if profiler_dir() is not None:   # as vLLM: the routes exist only when a trace directory is set
        @app.post("/start_profile")
        async def start_profile():
            try:
                await engine.start_profile()
            except ValueError as e:   # already running
                raise APIError(400, str(e)) from None
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile():
            try:
                return {"traces": await engine.stop_profile()}
            except ValueError as e:   # not running
                raise APIError(400, str(e)) from None

    return app
