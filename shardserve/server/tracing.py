"""OpenTelemetry request tracing (`--otlp-traces-endpoint`, vLLM's flag), optional: the `otel` extra.

One span per finished request (`llm_request`, kind SERVER, from arrival to finish) with vLLM's
attribute names (`gen_ai.*`), exported over OTLP/HTTP (protobuf) in batches. The span's parent is
the W3C `traceparent` the request came with, so a router's span and the server's share one trace.
Without `configure()` nothing here imports OpenTelemetry and every call is a no-op.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping
from urllib.parse import urlsplit

from shardserve.utils import MissingExtraError, installed

TRACE_HEADERS = ("traceparent", "tracestate")
_PACKAGES = ("opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http")   # the otel extra
_tracer: Any = None


def configure(endpoint: str | None, service_name: str = "shardserve") -> None:
    """Export spans to the OTLP/HTTP collector at `endpoint` (`http://host:4318` gets `/v1/traces`).
    Raises a one-line MissingExtraError (as utils.require_extra words it) without the `otel` extra."""
    global _tracer
    if not endpoint:
        return
    if not all(installed(m) for m in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")):
        raise MissingExtraError(f"--otlp-traces-endpoint needs {', '.join(_PACKAGES)}: pip install 'shardserve[otel]'")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=1000))
    _tracer = provider.get_tracer("vllm.llm_engine")   # vLLM's tracer name


def enabled() -> bool:
    return _tracer is not None


def _carrier(headers: Any) -> dict[str, str]:
    if headers is None:
        return {}
    items = headers.items() if isinstance(headers, Mapping) or hasattr(headers, "items") else headers
    out = {}
    for k, v in items:
        k = k.decode("latin-1") if isinstance(k, bytes) else k
        if k.lower() in TRACE_HEADERS:
            out[k.lower()] = v.decode("latin-1") if isinstance(v, bytes) else v
    return out


def _wall_ns(monotonic_s: float) -> int:
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def request_span(headers: Any, request_id: str, model: str, arrival: float, finished: float,
                 attributes: dict[str, Any]) -> str | None:
    """Emit one finished request's span (times are time.monotonic() values); returns its trace id
    (hex) or None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract(_carrier(headers))
    attrs = {"gen_ai.response.model": model, "gen_ai.request.id": request_id,
             **{k: v for k, v in attributes.items() if v is not None}}
    span = _tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER, attributes=attrs,
                              start_time=_wall_ns(arrival))
    span.end(end_time=_wall_ns(finished))
    return format(span.get_span_context().trace_id, "032x")


@contextmanager
def forwarded_context(headers: Any, name: str, attributes: dict[str, Any] | None = None) -> Iterator[dict[str, str]]:
    """For a proxy (the router): the trace headers to send on to backends. With tracing on, a span
    `name` (child of the incoming context) covers the block and the headers carry it; off, the
    incoming `traceparent` / `tracestate` pass through unchanged."""
    incoming = _carrier(headers)
    if _tracer is None:
        yield incoming
        return
    from opentelemetry.trace import SpanKind, set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    with _tracer.start_as_current_span(name, context=propagator.extract(incoming), kind=SpanKind.SERVER,
                                       attributes=attributes or {}) as span:
        out: dict[str, str] = {}
        propagator.inject(out, context=set_span_in_context(span))
        yield out
