"""Auth, --config files, queue limits, SIGTERM drain and a dead worker, each on its own real server
(a tiny random model keeps start-up short)."""
from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

import openai
import pytest

from tests.server.server_process import ServerProcess, get, post
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "ckpt"), "llama")


def _long(extra: dict | None = None) -> dict:
    return {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "temperature": 0, **(extra or {})}


def test_api_key_config_file_and_queue_limit(tiny, tmp_path, monkeypatch):
    """Also vLLM's logging flags, from the config file: no request lines, no periodic stats line
    (every 0.2 s otherwise), and --trust-remote-code accepted with a line saying it changes nothing."""
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {tiny}\nserved-model-name: tiny\nkv_cache_memory: 16MiB\nmax-num-seqs: 1\n"
                      "max-queue-len: 1\nenable-prefix-caching: false\ndisable-log-requests: true\n"
                      "disable_log_stats: true\ntrust-remote-code: true\nuvicorn-log-level: warning\n")
    srv = ServerProcess(["--config", str(config)], str(tmp_path / "server.log"),
                        env={"SHARDSERVE_API_KEY": "s3cret", "SHARDSERVE_LOG_STATS_INTERVAL": "0.2"})
    try:
        # Auth: /v1, /tokenize, /detokenize need the key; probes and metrics stay open.
        status, body, _ = post(srv.url + "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 401 and body["error"]["code"] == 401
        assert post(srv.url + "/tokenize", {"prompt": "hi"},
                    headers={"Authorization": "Bearer wrong"})[0] == 401
        assert post(srv.url + "/invocations", {"prompt": "hi", "max_tokens": 1})[0] == 401   # SageMaker's too
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        client = srv.client(api_key="s3cret")
        assert [m.id for m in client.models.list().data] == ["tiny"]   # the config file's name
        for path in ("/health", "/ping", "/metrics", "/version"):
            assert get(srv.url + path)[0] == 200, path
        # One running (max-num-seqs 1), one waiting (max-queue-len 1): the next is turned away.
        auth = {"Authorization": "Bearer s3cret"}
        results = []
        longest = _long({"max_tokens": 1000})   # seconds of decoding, even for the tiny model
        threads = [threading.Thread(target=lambda: results.append(post(srv.url + "/v1/completions", longest,
                                                                       headers=auth)))
                   for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.1)
        deadline = time.monotonic() + 20
        while srv.metrics()["vllm:num_requests_waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        status, body, headers = post(srv.url + "/v1/completions", _long(), headers=auth)
        assert status == 429 and headers["retry-after"] and "max-queue-len" in body["error"]["message"]
        for t in threads:
            t.join()
        assert [r[0] for r in results] == [200, 200]
        log = srv.read_log()
        assert "request_finished" not in log and "Avg prompt throughput" not in log
        assert "trust_remote_code changes nothing" in log
    finally:
        assert srv.stop() == 0


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny, tmp_path):
    srv = ServerProcess([tiny, "--kv-cache-memory", "16MiB"], str(tmp_path / "server.log"))
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(_long({"stream": True, "max_tokens": 150})),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    srv.proc.send_signal(signal.SIGTERM)
    events = [line for line in resp.read().decode().split("\n\n") if line.strip()]
    assert events[-1] == "data: [DONE]"
    finals = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finals[-1] == "length"   # all 150 tokens came out
    assert srv.proc.wait(30) == 0
    with pytest.raises(OSError):   # no longer accepting
        get(srv.url + "/health")
    srv.stop()


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def test_dead_worker_turns_health_to_503(tiny, tmp_path):
    srv = ServerProcess([tiny, "--kv-cache-memory", "16MiB", "--tensor-parallel-size", "2"],
                        str(tmp_path / "server.log"))
    try:
        assert post(srv.url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 200
        workers = _children(srv.proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while get(srv.url + "/health")[0] != 503:   # noticed while idle, without a request
            assert time.monotonic() < deadline, "health stayed 200 with a dead worker"
            time.sleep(0.2)
        status, body, _ = get(srv.url + "/health")
        assert "worker rank 1" in json.loads(body)["error"]["message"]
        status, body, _ = post(srv.url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
    finally:
        srv.stop()
