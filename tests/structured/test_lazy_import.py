"""xgrammar loads with the first constrained request, not with the engine: the GPU test machines
(and any install without it) still run everything else."""
from __future__ import annotations

import subprocess
import sys


def test_engine_and_worker_import_without_xgrammar():
    code = ("import sys; import shardserve.llm, shardserve.engine.engine, shardserve.worker.model_runner; "
            "assert 'xgrammar' not in sys.modules, 'imported xgrammar'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
