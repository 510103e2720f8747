"""Misbehaving OpenAI-compatible endpoints on real loopback sockets, for the router tests: one that
answers 500, one that stalls, one that sends invalid JSON, and a scripted one (fixed content and
usage, optional slow streaming) whose numbers tests can check exactly."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SCRIPTED_USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


class _Handler(BaseHTTPRequestHandler):
    behaviour = "scripted"
    reply = '{"consensus": ["c"], "contradictions": [], "unique_insights": [], "blind_spots": []}'
    seen: list[dict] = []

    def log_message(self, *args):   # keep test output quiet
        pass

    def do_GET(self):
        self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        type(self).seen.append({"body": body, "headers": dict(self.headers)})
        if self.behaviour == "error500":
            return self._json(500, {"error": {"message": "boom", "type": "InternalServerError", "code": 500}})
        if self.behaviour == "stall":
            time.sleep(30)
            return self._json(200, {})
        if self.behaviour == "garbage":
            data = b"this is not json"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if body.get("stream"):
            return self._stream()
        self._json(200, {"id": "x", "object": "chat.completion", "model": body.get("model"),
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": self.reply},
                                      "finish_reason": "stop"}], "usage": SCRIPTED_USAGE})

    def _stream(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for word in ["Final", " answer", " in", " five", " words"]:
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": word},
                                                                    "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.2)   # slow on purpose: the router must pass chunks on as they come
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': SCRIPTED_USAGE})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _json(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def start_fake(behaviour: str) -> tuple[ThreadingHTTPServer, str]:
    handler = type(f"Fake_{behaviour}", (_Handler,), {"behaviour": behaviour, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"
