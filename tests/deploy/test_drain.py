"""Graceful drain on a real `shardserve serve`: SIGTERM with streams in flight turns /health and new
requests to 503 while the streams run to their end, then the process exits 0; a drain that outlasts
--shutdown-timeout stops the stragglers and still exits 0."""
from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import pytest

from tests.server.server_process import ServerProcess, get, post
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # A long context: the outlasting streams must run for seconds even on a fast host (4 streams of 1000
    # tokens ended in ~1.5 s on a 2-core CPU, before the drain's time plus uvicorn's grace had cut them).
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_drain") / "ckpt"), "llama",
                                max_position_embeddings=4096)


def _open_stream(port: int, max_tokens: int) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    return resp


def _events(resp: http.client.HTTPResponse) -> list[str]:
    try:
        text = resp.read().decode()
    except http.client.IncompleteRead as e:   # a stream cut when the drain timed out
        text = e.partial.decode()
    return [e for e in text.split("\n\n") if e.strip()]


def test_sigterm_drains_streams_refuses_new_requests_and_exits_0(tiny, tmp_path):
    srv = ServerProcess([tiny, "--kv-cache-memory", "16MiB", "--shutdown-timeout", "60"], str(tmp_path / "s.log"))
    try:
        streams = [_open_stream(srv.port, 400) for _ in range(2)]
        results: list[list[str]] = [[], []]
        readers = [threading.Thread(target=lambda i=i: results[i].extend(_events(streams[i]))) for i in range(2)]
        for t in readers:
            t.start()
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while get(srv.url + "/health")[0] != 503:   # readiness fails while draining
            assert time.monotonic() < deadline
            time.sleep(0.05)
        status, body, _ = post(srv.url + "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 503 and body["error"]["code"] == 503 and "shutting down" in body["error"]["message"]
        assert get(srv.url + "/ping")[0] == 200       # liveness holds: the pod is not killed mid-drain
        assert get(srv.url + "/metrics")[0] == 200
        assert srv.proc.poll() is None                 # still running: the streams are not done
        for t in readers:
            t.join(60)
        for events in results:
            assert events[-1] == "data: [DONE]"
            tokens = sum(len(json.loads(e[6:])["choices"][0]["text"]) > 0 for e in events[:-1])
            assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length" and tokens > 100
        assert srv.proc.wait(30) == 0
        assert "drained: no request in flight" in srv.read_log()
    finally:
        srv.stop()


def test_drain_that_outlasts_shutdown_timeout_stops_and_exits_0(tiny, tmp_path):
    srv = ServerProcess([tiny, "--kv-cache-memory", "16MiB", "--shutdown-timeout", "0.3"], str(tmp_path / "s.log"))
    try:
        streams = [_open_stream(srv.port, 4000) for _ in range(4)]   # the tiny model's whole context, 4 at once
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        events = [_events(s) for s in streams]
        assert srv.proc.wait(30) == 0 and time.monotonic() - start < 20
        assert all(e[-1] != "data: [DONE]" for e in events)     # cut short
        assert "drain timed out with 4 requests in flight" in srv.read_log()
    finally:
        srv.stop()
