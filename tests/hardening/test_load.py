"""A bounded soak and overload run of benchmarks/load_soak.py against the embedded model (issue 29):
streams, non-streaming requests, client aborts, prompts near the context limit and n > 1 from more
clients than --max-num-seqs + --max-queue-len admit; every request answered, refused with a clear
status (429 with Retry-After) or aborted by the client, and the server idle and healthy at the end.
The script runs for minutes by hand; here SOAK_SECONDS (25)."""
from __future__ import annotations

import importlib.util
import os

import pytest

from tests.server.server_process import ServerProcess

_SPEC = importlib.util.spec_from_file_location(
    "load_soak", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "load_soak.py"))
load_soak = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(load_soak)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(["--max-model-len", "256", "--kv-cache-memory", "64MiB", "--max-num-seqs", "4",
                         "--max-queue-len", "4"], str(tmp_path_factory.mktemp("load") / "server.log"))
    yield srv
    srv.stop()


def test_soak_and_overload_lose_nothing(server):
    result = load_soak.soak(server.url, "HuggingFaceTB/SmolLM2-135M-Instruct", 256,
                            float(os.environ.get("SOAK_SECONDS", "25")), 12, 24, server.proc.pid)
    assert load_soak.check(result) == [], result
    outcomes = result["soak_outcomes"]
    assert outcomes.get("stream:200") and outcomes.get("n3:200") and outcomes.get("long_prompt:200"), result
    assert outcomes.get("abort:aborted"), result
    assert sum(v for k, v in outcomes.items() if k.endswith(":429")), result   # overload was reached
    assert result["ttft_p50_s"] is not None
