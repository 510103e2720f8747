"""Running a test's Triton kernels on the CPU: Triton's interpreter (TRITON_INTERPRET=1) is read when
the kernels are defined, so the check runs in a fresh Python process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

TRITON_REASON = "triton comes with xgrammar, a core dependency: only a broken install lacks it"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(module: str, function: str, timeout: int = 600) -> None:
    """Call `module.function()` (a test module's check, raising on failure) under the interpreter."""
    pytest.importorskip("triton", reason=TRITON_REASON)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", f"from {module} import {function}; {function}()"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
