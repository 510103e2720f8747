"""The `shardserve` command as users run it (a real subprocess, the embedded model)."""
from __future__ import annotations

import os
import subprocess
import sys


def _cli(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_chat_message_answers_paris():
    done = _cli("chat", "--message", "What is the capital of France?", "--max-model-len", "2048",
                "--kv-cache-memory", "512MiB")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
    assert "KV cache size:" in done.stderr and "Maximum concurrency for 2048 tokens per request" in done.stderr


def test_bad_arguments_are_one_line_errors():
    missing = _cli("chat", "--model", "/nonexistent/model", "--message", "hi")
    assert missing.returncode == 2 and "error: model '/nonexistent/model' not found" in missing.stderr
    bad_tp = _cli("chat", "-tp", "2", "--message", "hi")
    assert bad_tp.returncode == 2 and "sizes that work: 1, 3" in bad_tp.stderr
    assert "Traceback" not in missing.stderr + bad_tp.stderr
