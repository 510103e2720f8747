"""A real OTLP/HTTP trace receiver (protobuf, `POST /v1/traces`) on a loopback port, keeping the spans
it gets as plain dicts."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):   # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                receiver.paths.append(self.path)
                for rs in request.resource_spans:
                    service = {a.key: _value(a.value) for a in rs.resource.attributes}.get("service.name")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            receiver.spans.append({
                                "name": s.name, "service": service, "scope": ss.scope.name,
                                "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                "parent_span_id": s.parent_span_id.hex(), "kind": s.kind,
                                "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                                "attributes": {a.key: _value(a.value) for a in s.attributes}})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, predicate, timeout_s: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [s for s in list(self.spans) if predicate(s)]
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no matching span in {timeout_s} s; got {self.spans}")

    def close(self) -> None:
        self.server.shutdown()
