"""A multi-node launch whose peer never arrives (issue 29), as users start it: `shardserve serve
--nnodes 2` on node 0 with no node 1 exits within --distributed-timeout-s (plus start-up) with one
error line naming the missing ranks and the command that starts them; a `shardserve worker` node
whose engine never comes up exits naming its ranks and the address it dialled."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shardserve.executor.multiproc import free_port
from tests.tiny_models import make_tiny_checkpoint

TIMEOUT_S = 3
STARTUP_S = 45   # imports and the local workers' start on a busy 2-core machine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_rdv")), "llama")


def _run(args: list[str]) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "shardserve.cli", *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S + STARTUP_S, env=_env())
    return proc.returncode, proc.stderr, time.monotonic() - start


def _env() -> dict[str, str]:
    return {**os.environ, "SHARDSERVE_CLUSTER_KEY": "test-secret"}


def test_serve_with_a_node_missing_names_its_ranks(tiny):
    port = free_port()
    # TP 2 x PP 2 over 2 nodes: ranks 0 and 1 here (they connect), 2 and 3 on the node that never starts.
    code, err, seconds = _run(["serve", tiny, "--kv-cache-memory", "16MiB", "-tp", "2", "-pp", "2", "--nnodes", "2",
                               "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--distributed-timeout-s", str(TIMEOUT_S), "--port", str(free_port())])
    assert code == 1, err[-3000:]
    assert (f"error: worker ranks [2, 3] did not connect to the engine at 127.0.0.1:{port + 1} within "
            f"{TIMEOUT_S} s; start the other nodes with `shardserve worker --nnodes 2 --node-rank N "
            f"--master-addr 127.0.0.1 --master-port {port}`") in err, err[-3000:]
    assert "Traceback" not in err
    assert seconds < TIMEOUT_S + STARTUP_S


def test_headless_node_without_an_engine_names_its_ranks():
    port = free_port()
    code, err, seconds = _run(["worker", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                               "--master-port", str(port), "-tp", "4", "--distributed-timeout-s", str(TIMEOUT_S)])
    assert code == 1, err[-3000:]
    for rank in (2, 3):
        assert f"worker rank {rank}: no engine answered at 127.0.0.1:{port + 1} within {TIMEOUT_S} s" in err, err
    assert seconds < TIMEOUT_S + STARTUP_S
