"""An OpenAI chat endpoint in its own process that fails the way real backends do, for the router
fault tests: `die` reads a request, then SIGKILLs itself before answering; `die-mid-stream` streams
two chunks of a streamed request, then SIGKILLs itself (a non-streamed one, a judge's analysis, gets
an answer); `silent` accepts connections and reads them, never answering.
`GET /models` answers in every mode, so the router's health probes see a live backend until the
fault. Run as `python tests/hardening/fault_backend.py MODE PORT`; `FaultBackend` starts one."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("die", "die-mid-stream", "silent")


class _Handler(BaseHTTPRequestHandler):
    mode = "die"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._json({"object": "list", "data": [{"id": "fault", "object": "model"}]})

    def _json(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.mode == "silent":   # the request is in; no answer will ever come
            threading.Event().wait()
        if self.mode == "die-mid-stream" and not body.get("stream"):   # a judge's analysis: answered
            return self._json({"object": "chat.completion", "usage": None, "choices": [{
                "index": 0, "message": {"role": "assistant", "content": '{"consensus": ["x"]}'},
                "finish_reason": "stop"}]})
        if self.mode == "die-mid-stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for word in ("Half", " an"):
                chunk = {"object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)   # the whole backend process dies, mid-request


class FaultBackend:
    """One fault backend process on a fixed port (so the router's config can name it before it
    runs); `start()` again after it died brings a fresh one up on the same port."""

    def __init__(self, mode: str, port: int) -> None:
        assert mode in MODES
        self.mode, self.port = mode, port
        self.url = f"http://127.0.0.1:{port}/v1"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, self.mode, str(self.port)])
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"fault backend {self.mode} did not start (exit {self.proc.poll()})")
                time.sleep(0.05)

    def wait_dead(self, timeout_s: float = 10.0) -> int:
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    mode, port = sys.argv[1], int(sys.argv[2])
    handler = type("Handler", (_Handler,), {"mode": mode})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    server.serve_forever()
