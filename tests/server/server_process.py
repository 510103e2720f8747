"""A real `shardserve serve` (or `shardserve router`) process on a free loopback port, and small
raw-HTTP helpers."""
from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from shardserve.executor.multiproc import free_port

STARTUP_TIMEOUT_S = 180


class ServerProcess:
    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None,
                 command: str = "serve", tls: ssl.SSLContext | None = None) -> None:
        """tls: a client context trusting the server's certificate (it serves HTTPS)."""
        self.port = free_port()
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "shardserve.cli", command, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if request("GET", self.url + "/health", timeout=10, context=tls)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server did not become healthy in {STARTUP_TIMEOUT_S} s:\n{self.read_log()}")

    def read_log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def client(self, api_key: str = "none", asynchronous: bool = False):
        import openai
        cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return cls(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """Sample values summed over labels, keyed by name; `name{label="v"}` keys too."""
        _, body, _ = get(self.url + "/metrics")
        values: dict[str, float] = {}
        for line in body.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            name = key.split("{")[0]
            values[name] = values.get(name, 0.0) + float(value)
            if "{" in key:
                for label in key[key.index("{") + 1:-1].split(","):
                    if not label.startswith("model_name="):
                        values[f"{name}{{{label}}}"] = values.get(f"{name}{{{label}}}", 0.0) + float(value)
        return values

    def wait_idle(self, timeout_s: float = 20.0) -> dict[str, float]:
        """Metrics once nothing runs, waits, or holds KV blocks."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == m["vllm:kv_cache_usage_perc"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout_s} s: {m}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def request(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
            raw: bytes | None = None, timeout: float = 120,
            context: ssl.SSLContext | None = None) -> tuple[int, bytes, dict[str, str]]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    return request("GET", url, headers=headers, timeout=10)


def post(url: str, body: Any = None, **kw) -> tuple[int, Any, dict[str, str]]:
    status, data, headers = request("POST", url, body, **kw)
    try:
        return status, json.loads(data), headers
    except json.JSONDecodeError:
        return status, data, headers


def server_fixture(*args: str):
    """A module-scoped pytest fixture: one `shardserve serve` with these flags for the module's
    tests, stopped after them."""
    import pytest

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        srv = ServerProcess(list(args), str(tmp_path_factory.mktemp("server") / "server.log"))
        yield srv
        srv.stop()
    return server
