"""A worker of a TP=2 or PP=2 server (CPU, gloo, one process per rank) killed with SIGKILL while a
stream is in flight (issue 29): the stream ends with an error event and `[DONE]` (no hang), /health
turns 503 naming the rank, new requests get 503, the surviving worker goes away, and the server stays
up answering 503 until its orchestrator restarts it (docs/server.md, "Limits, errors and faults");
SIGTERM then stops it with exit code 0."""
from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

import pytest

from tests.distributed.test_faults_and_smollm2 import _alive
from tests.server.server_process import ServerProcess, get, post
from tests.server.test_server_lifecycle import _children
from tests.tiny_models import make_tiny_checkpoint

NOTICE_S = 5   # a dead worker is noticed within this (the engine polls its workers every second)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "ckpt"), "llama")


def _wait_running(srv: ServerProcess, n: int) -> None:
    deadline = time.monotonic() + 10
    while srv.metrics()["vllm:num_requests_running"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _rank_pid(workers: list[int], rank: int) -> int:
    """The worker process of a rank: its command line ends with it (`worker_proc HOST PORT RANK`)."""
    for pid in workers:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")[:-1]
        if b"shardserve.executor.worker_proc" in argv and argv[-1] == str(rank).encode():
            return pid
    raise AssertionError(f"no worker process of rank {rank} among {workers}")


def _events(resp: http.client.HTTPResponse) -> list[str]:
    return [e for e in resp.read().decode().split("\n\n") if e.strip()]


# TP: the second rank dies; PP: the first stage (rank 0, whose hidden states the last stage waits for).
@pytest.mark.parametrize("layout,rank", [("--tensor-parallel-size", 1), ("--pipeline-parallel-size", 0)])
def test_worker_killed_mid_stream(tiny, tmp_path, layout, rank):
    srv = ServerProcess([tiny, "--served-model-name", "tiny", "--kv-cache-memory", "16MiB", layout, "2"],
                        str(tmp_path / "server.log"))
    try:
        workers = _children(srv.proc.pid)
        assert len(workers) == 2
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")   # generating now
        waiting = []   # a non-streaming request in flight too
        blocking = threading.Thread(target=lambda: waiting.append(post(srv.url + "/v1/completions", {
            "model": "tiny", "prompt": [8, 9], "max_tokens": 1000, "ignore_eos": True}, timeout=30)))
        blocking.start()
        _wait_running(srv, 2)
        victim = _rank_pid(workers, rank)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        events = _events(resp)   # the socket timeout (30 s) turns a hang into a failure
        assert time.monotonic() - killed < NOTICE_S, "the stream outlived the worker by too long"
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: "):])["error"]
        assert error["code"] == 503 and f"worker rank {rank} (pid {victim}) died" in error["message"], error
        assert not any('"finish_reason": "length"' in e for e in events)   # cut short, not finished
        blocking.join(NOTICE_S)
        assert not blocking.is_alive() and waiting[0][0] == 503, waiting

        status, body, _ = get(srv.url + "/health")
        assert status == 503 and "worker rank" in json.loads(body)["error"]["message"]
        assert get(srv.url + "/ping")[0] == 503
        for path, body in (("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})):
            status, answer, _ = post(srv.url + path, body)
            assert status == 503 and answer["error"]["type"] == "ServiceUnavailableError", answer
        # The other rank does not linger, blocked in a collective with a dead peer.
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers), "a worker process outlived the failed engine"
        # Deliberately still up (an orchestrator's liveness probe restarts it), still answering.
        time.sleep(1)
        assert srv.proc.poll() is None and get(srv.url + "/health")[0] == 503
        assert get(srv.url + "/metrics")[0] == 200
    finally:
        code = srv.stop()
    assert code == 0, srv.read_log()[-3000:]
