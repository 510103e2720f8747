"""The OpenAPI document (/openapi.json) of the server and the router, with the request bodies and
error responses the routes really have. Bodies are parsed by hand (api.py's `_json_body`, the
router's plain-ASGI POSTs), so FastAPI cannot see them; this declares them without changing how
requests are handled, for clients, docs and schema fuzzers (Schemathesis, tests/hardening/)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"

ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}

_ERRORS = {"400": "invalid request (malformed JSON, a field out of range, a prompt too long)",
           "401": "missing or wrong API key", "404": "unknown model", "413": "request body too large",
           "429": "queue full (--max-queue-len); see Retry-After", "499": "client disconnected",
           "500": "internal error", "502": "a backend failed (router)", "503": "engine not running or draining",
           "504": "a backend timed out (router)"}


def _operation(model: type[BaseModel], summary: str, streams: bool) -> dict[str, Any]:
    ok = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok["text/event-stream"] = {"schema": {}}   # data: events (JSON chunks, then [DONE])
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    responses.update({code: {"description": text, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model="ErrorResponse")}}}} for code, text in _ERRORS.items()})
    return {"summary": summary, "operationId": summary.lower().replace(" ", "_"),
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=model.__name__)}}}},
            "responses": responses}


def document_bodies(app: FastAPI, posts: dict[str, tuple[type[BaseModel], str, bool]]) -> None:
    """Make app.openapi() declare POST `path` with `model` as its JSON body: posts maps a path to
    (model, summary, may stream). Paths FastAPI does not route (the router's) are added too."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m, _, _ in posts.values()], ref_template=_REF)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(defs.get("$defs", {}))
            components["ErrorResponse"] = ERROR_SCHEMA
            for path, (model, summary, streams) in posts.items():
                schema.setdefault("paths", {}).setdefault(path, {})["post"] = _operation(model, summary, streams)
            for operations in schema.get("paths", {}).values():   # any route may answer an error
                for op in operations.values():
                    for code, text in _ERRORS.items():
                        op["responses"].setdefault(code, {"description": text, "content": {"application/json": {
                            "schema": {"$ref": _REF.format(model="ErrorResponse")}}}})
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi
