"""`shardserve bench serve` against a real server: counts, timings and the saved JSON; failures are
counted, not fatal; the summary's arithmetic on hand-made results."""
from __future__ import annotations

import json
import os

import pytest

from shardserve.bench.serve import RequestResult, summarize
from shardserve.cli import main
from tests.server.server_process import ServerProcess, get, post
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    path = make_tiny_checkpoint(str(tmp / "ckpt"), "llama")
    srv = ServerProcess([path, "--kv-cache-memory", "16MiB", "--served-model-name", "tiny"], str(tmp / "server.log"))
    yield srv, path
    srv.stop()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_measures_a_real_server(tiny_server, tmp_path, capsys, endpoint):
    srv, path = tiny_server
    rc = main(["bench", "serve", "--base-url", srv.url, "--endpoint", endpoint, "--tokenizer", path,
               "--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "5", "--ignore-eos",
               "--max-concurrency", "3", "--request-rate", "50", "--save-result", "--result-dir", str(tmp_path),
               "--result-filename", "out.json", "--metric-percentiles", "90,99"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "P90 TTFT (ms):" in printed
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 30   # ignore_eos: exactly the output length, per server usage
    assert all(r["prompt_len"] > 0 for r in result["requests"])
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert all(len(r["itl"]) <= 4 for r in result["requests"])


def test_failed_requests_are_counted(tiny_server, capsys):
    srv, path = tiny_server
    rc = main(["bench", "serve", "--base-url", srv.url, "--model", "not-served", "--tokenizer", path,
               "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2"])
    assert rc == 1
    out = capsys.readouterr().out
    assert "Failed requests:                        2" in out and "HTTP 404" in out


def test_profile_needs_a_server_with_a_trace_directory(tiny_server, capsys):
    srv, path = tiny_server
    rc = main(["bench", "serve", "--base-url", srv.url, "--tokenizer", path, "--num-prompts", "1",
               "--random-input-len", "4", "--random-output-len", "2", "--profile"])
    assert rc == 2 and "SHARDSERVE_TORCH_PROFILER_DIR" in capsys.readouterr().err


def test_profile_traces_the_servers_workers(tmp_path, capsys):
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    traces = tmp_path / "traces"
    srv = ServerProcess([path, "--kv-cache-memory", "16MiB"], str(tmp_path / "server.log"),
                        env={"SHARDSERVE_TORCH_PROFILER_DIR": str(traces)})
    try:
        status, body, _ = post(srv.url + "/stop_profile", {})
        assert status == 400 and "not running" in body["error"]["message"]
        rc = main(["bench", "serve", "--base-url", srv.url, "--tokenizer", path, "--num-prompts", "3",
                   "--random-input-len", "6", "--random-output-len", "3", "--ignore-eos", "--profile"])
        assert rc == 0
        printed = [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines()
                   if line.startswith("profile trace: ")]
        assert len(printed) == 1 and os.path.dirname(printed[0]) == str(traces) and os.path.getsize(printed[0]) > 0
        assert get(srv.url + "/health")[0] == 200   # profiling stopped cleanly; the server goes on
    finally:
        srv.stop()


def test_summary_arithmetic():
    results = [RequestResult(True, "", 10, 5, ttft=0.1, e2el=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
               RequestResult(True, "", 20, 3, ttft=0.3, e2el=0.7, itl=[0.2, 0.2]),
               RequestResult(False, "HTTP 500: boom")]
    s = summarize(results, duration=2.0)
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 30, 8)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.0 and s["total_token_throughput"] == 19.0
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_e2el_ms"] == pytest.approx(600)
    assert s["mean_tpot_ms"] == pytest.approx((100 + 200) / 2)   # (e2el - ttft) / (tokens - 1)
    assert s["mean_itl_ms"] == pytest.approx(800 / 6) and s["errors"] == ["HTTP 500: boom"]
