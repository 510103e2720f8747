"""Observability as an operator meets it, on real processes: vLLM's metric names (old ones too) and the
seeds' prometheus_check.py list, no `_created` series, the JSON request log agreeing with /metrics,
OTLP spans (vLLM's attribute names) from `shardserve serve` and `shardserve router` arriving at a real
OTLP/HTTP receiver in one trace, and the Grafana dashboard naming only series that exist."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import time

import pytest
import yaml

from tests.server.otlp_receiver import OtlpReceiver  # needs the otel extra, which the test extra includes
from tests.server.server_process import ServerProcess, get, post
from tests.tiny_models import make_tiny_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "shardserve-dashboard.json"

# /work/shared/seeds' prometheus_check.py: "key metrics to alert on", as a vLLM user's script lists them
SEED_METRICS = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
                "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                "vllm:e2e_request_latency_seconds"]
VLLM_METRICS = SEED_METRICS + [
    "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:iteration_tokens_total", "vllm:cache_config_info",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observability")
    receiver = OtlpReceiver()
    ckpt = make_tiny_checkpoint(str(tmp / "ckpt"), "llama")
    server = ServerProcess([ckpt, "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
                            "--otlp-traces-endpoint", receiver.url], str(tmp / "server.log"),
                           env={"SHARDSERVE_LOG_STATS_INTERVAL": "0.3"})
    config = {"backends": [{"id": "tiny", "type": "shardserve", "base_url": server.url + "/v1", "model": "tiny"}],
              "default_model": "tiny"}
    (tmp / "router.yaml").write_text(yaml.safe_dump(config))
    router = ServerProcess(["--config", str(tmp / "router.yaml"), "--otlp-traces-endpoint",
                            receiver.url + "/v1/traces"], str(tmp / "router.log"), command="router")
    yield server, router, receiver
    router.stop()
    server.stop()
    receiver.close()


def _exposition(url: str) -> str:
    status, body, _ = get(url + "/metrics")
    assert status == 200
    return body.decode()


def _series_names(text: str) -> set[str]:
    """Every series name a scrape can carry: the samples, and for families with no sample yet
    (labelled, never observed) the names their TYPE line implies."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return names


def test_seed_check_finds_every_metric_and_no_created_series(stack):
    server, router, _ = stack
    post(server.url + "/v1/completions", {"model": "tiny", "prompt": "warm up", "max_tokens": 4})
    lines = _exposition(server.url).splitlines()
    # the seeds' prometheus_check.py: a metric counts if a sample line starts with its name
    missing = [m for m in SEED_METRICS if not any(ln.startswith(m) and not ln.startswith("#") for ln in lines)]
    assert missing == []
    names = _series_names("\n".join(lines))
    assert [m for m in VLLM_METRICS if not any(n == m or n.startswith(m + "_") for n in names)] == []
    for text in ("\n".join(lines), _exposition(router.url)):
        assert not [ln for ln in text.splitlines() if "_created" in ln]
    info = next(ln for ln in lines if ln.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and info.endswith(" 1.0")


def test_old_names_carry_the_same_values(stack):
    server, _, _ = stack
    post(server.url + "/v1/completions", {"model": "tiny", "prompt": "old names", "max_tokens": 6})
    m = server.metrics()
    assert m["vllm:time_per_output_token_seconds_count"] == m["vllm:inter_token_latency_seconds_count"] > 0
    assert m["vllm:time_per_output_token_seconds_sum"] == m["vllm:inter_token_latency_seconds_sum"]
    assert m["vllm:gpu_cache_usage_perc"] == m["vllm:kv_cache_usage_perc"]
    assert m["vllm:gpu_prefix_cache_queries_total"] == m["vllm:prefix_cache_queries_total"] > 0
    assert m["vllm:iteration_tokens_total_count"] > 0 and m["vllm:request_prefill_time_seconds_count"] > 0


def _log_line(server: ServerProcess, request_id: str) -> dict:
    for line in server.read_log().splitlines():
        if '"request_finished"' in line and f'"request_id": "{request_id}"' in line:
            return json.loads(line[line.index("{"):])
    raise AssertionError(f"no log line for {request_id}")


def test_request_log_and_metrics_agree(stack):
    server, _, _ = stack
    server.wait_idle()
    before = server.metrics()
    status, body, _ = post(server.url + "/v1/completions", {"model": "tiny", "prompt": "agree on this", "max_tokens": 9,
                                                             "ignore_eos": True}, headers={"X-Request-Id": "agree-1"})
    assert status == 200
    after = server.wait_idle()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    log = _log_line(server, "agree-1")
    assert log["prompt_tokens"] == delta["vllm:prompt_tokens_total"] == body["usage"]["prompt_tokens"]
    assert log["completion_tokens"] == delta["vllm:generation_tokens_total"] == body["usage"]["completion_tokens"] == 9
    assert delta["vllm:time_to_first_token_seconds_count"] == 1
    assert log["ttft_s"] == pytest.approx(delta["vllm:time_to_first_token_seconds_sum"], abs=2e-6)
    assert log["e2e_s"] == pytest.approx(delta["vllm:e2e_request_latency_seconds_sum"], abs=2e-6)
    assert log["tpot_s"] == pytest.approx(delta["vllm:request_time_per_output_token_seconds_sum"], abs=2e-6)
    assert log["queue_s"] == pytest.approx(delta["vllm:request_queue_time_seconds_sum"], abs=2e-6)


def test_periodic_stats_line(stack):
    """vLLM's periodic line: after a request, one whose generation throughput counts its tokens; idle
    intervals log nothing."""
    server, _, _ = stack
    server.wait_idle()
    time.sleep(0.7)   # an idle interval or two: no line
    before = server.read_log().count("Avg prompt throughput")
    time.sleep(0.7)
    assert server.read_log().count("Avg prompt throughput") == before
    assert post(server.url + "/v1/completions", {"model": "tiny", "prompt": "count me", "max_tokens": 12,
                                                 "ignore_eos": True})[0] == 200
    pattern = (r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
               r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%")
    # A line logged while the request ran but before its first output counts nothing yet: wait for
    # the line of the interval its tokens fell in.
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in server.read_log().splitlines() if "Avg prompt throughput" in line][before:]
        found = [re.search(pattern, line) for line in lines]
        assert all(found), lines
        if sum(float(m.group(2)) for m in found) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(float(m.group(2)) for m in found) > 0 and sum(float(m.group(1)) for m in found) > 0, lines


def test_spans_arrive_in_one_trace_through_the_router(stack):
    server, router, receiver = stack
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    status, body, _ = post(router.url + "/v1/chat/completions",
                           {"model": "tiny", "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 5,
                            "temperature": 0.5}, headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    assert status == 200
    (router_span,) = receiver.wait_for(lambda s: s["trace_id"] == trace_id and s["name"] == "router_request")
    (span,) = receiver.wait_for(lambda s: s["trace_id"] == trace_id and s["name"] == "llm_request")
    assert router_span["parent_span_id"] == parent and router_span["service"] == "shardserve-router"
    assert span["parent_span_id"] == router_span["span_id"] and span["service"] == "shardserve"
    a = span["attributes"]
    assert span["scope"] == "vllm.llm_engine" and span["kind"] == 2   # SPAN_KIND_SERVER
    assert a["gen_ai.response.model"] == "tiny" and a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.usage.prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == body["usage"]["completion_tokens"]
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.usage.num_sequences"] == 1
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert span["end_ns"] - span["start_ns"] == pytest.approx(a["gen_ai.latency.e2e"] * 1e9, abs=2e6)
    assert set(receiver.paths) == {"/v1/traces"}   # a bare collector URL gets OTLP's path
    log = _log_line(server, a["gen_ai.request.id"])
    assert log["trace_id"] == trace_id and log["completion_tokens"] == a["gen_ai.usage.completion_tokens"]


def test_dashboard_queries_name_only_exposed_series(stack):
    server, router, _ = stack
    exposed = _series_names(_exposition(server.url)) | _series_names(_exposition(router.url))
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    named = {n for e in exprs for n in re.findall(r"\b(vllm:[A-Za-z0-9_:]+|router_[A-Za-z0-9_]+)", e)}
    assert len(named) >= 20 and sorted(named - exposed) == []
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for panel in ("request rate", "time to first token", "inter-token", "end-to-end", "tokens per second",
                  "kv cache", "queue", "preemptions", "prefix cache hit", "router decisions", "fusion outcomes"):
        assert panel in titles


def test_otlp_endpoint_without_the_extra_is_one_line(tmp_path):
    from tests.test_packaging import HIDE_SHIM
    (tmp_path / "sitecustomize.py").write_text(HIDE_SHIM)
    env = {"SHARDSERVE_TEST_HIDE": "opentelemetry", "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    done = subprocess.run([sys.executable, "-m", "shardserve", "serve", "--otlp-traces-endpoint", "http://x:4318",
                           "--port", "1"], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, **env})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --otlp-traces-endpoint needs opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http: "
        "pip install 'shardserve[otel]'")
