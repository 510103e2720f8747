"""A real Prometheus (Debian's `prometheus` package, which `make test` installs) scraping a live
`shardserve serve` and `shardserve router` through deploy/prometheus/prometheus.yml and rules.yml;
PromQL answers what the test caused: requests queued behind `--max-num-seqs 1`, KV blocks held,
tokens generated, TTFT p95, router decisions and a fusion panel member that failed."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from tests.server.server_process import ServerProcess, free_port, get, post
from tests.tiny_models import make_tiny_checkpoint

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
NOT_INSTALLED = ("Prometheus is not installed: `make test` installs Debian's `prometheus` package with apt-get "
                 "(as root), which was not possible here")
N_QUEUED = 5        # concurrent requests against --max-num-seqs 1: one runs, the others wait
MAX_TOKENS = 900    # long enough (about a second each on 2 CPU cores) for several scrapes per request


def test_shipped_rules_pass_promtool():
    if shutil.which("promtool") is None:
        pytest.skip(NOT_INSTALLED)
    for args in (["check", "rules", str(DEPLOY / "rules.yml")], ["check", "config", str(DEPLOY / "prometheus.yml")]):
        done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.skip(NOT_INSTALLED)
    tmp = tmp_path_factory.mktemp("prometheus")
    ckpt = make_tiny_checkpoint(str(tmp / "ckpt"), "llama")
    server = ServerProcess([ckpt, "--kv-cache-memory", "16MiB", "--served-model-name", "tiny", "--max-num-seqs", "1"],
                           str(tmp / "server.log"))
    dead = f"http://127.0.0.1:{free_port()}/v1"
    router_config = {"backends": [{"id": "tiny", "type": "shardserve", "base_url": server.url + "/v1", "model": "tiny"},
                                  {"id": "dead", "type": "vllm", "base_url": dead, "model": "dead"}],
                     "decisions": [{"id": "panel", "algorithm": {"type": "fusion", "analysis_models": ["tiny", "dead"],
                                                                 "judge_model": "tiny", "on_error": "skip"},
                                    "signals": [{"type": "keyword", "keywords": ["panel"]}]}],
                     "default_model": "tiny"}
    (tmp / "router.yaml").write_text(yaml.safe_dump(router_config))
    router = ServerProcess(["--config", str(tmp / "router.yaml")], str(tmp / "router.log"), command="router")
    # the shipped scrape config and rules, with live targets and a test-sized scrape interval
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="250ms", evaluation_interval="250ms")
    config["rule_files"] = [str(DEPLOY / "rules.yml")]
    targets = {"shardserve": server.url, "shardserve-router": router.url}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]].removeprefix("http://")]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp / "prometheus.log", "w")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'db'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _ready(url), "Prometheus did not become ready", tmp / "prometheus.log")
        _wait(lambda: _query(url, "count(up == 1)") == [2.0], "Prometheus did not scrape both targets",
              tmp / "prometheus.log")
        yield url, server, _workload(server, router)
    finally:
        prom.terminate()
        prom.wait(30)
        log.close()
        router.stop()
        server.stop()


def _ready(url: str) -> bool:
    try:
        return get(url + "/-/ready")[0] == 200
    except OSError:
        return False


def _wait(predicate, message: str, log_path=None, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(message + ("" if log_path is None else ":\n" + open(log_path).read()[-3000:]))


def _query(url: str, promql: str) -> list[float]:
    status, body, _ = get(url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    data = json.loads(body)
    assert status == 200 and data["status"] == "success", data
    return [float(r["value"][1]) for r in data["data"]["result"]]


def _workload(server: ServerProcess, router: ServerProcess) -> dict:
    def ask(i: int):
        start = time.monotonic()
        status, body, _ = post(server.url + "/v1/completions", {"model": "tiny", "prompt": f"request {i}",
                                                                 "max_tokens": MAX_TOKENS, "ignore_eos": True})
        assert status == 200, body
        return body["usage"]["completion_tokens"], time.monotonic() - start
    with ThreadPoolExecutor(N_QUEUED) as pool:
        results = list(pool.map(ask, range(N_QUEUED)))
    static = post(router.url + "/v1/chat/completions", {"model": "vllm-sr/auto", "max_tokens": 7,
                                                        "messages": [{"role": "user", "content": "hello"}]})
    fusion = post(router.url + "/v1/chat/completions", {"model": "vllm-sr/auto", "max_tokens": 7,
                                                        "messages": [{"role": "user", "content": "panel please"}]})
    assert static[0] == 200 and fusion[0] == 200, (static, fusion)
    assert static[2]["x-vsr-selected-decision"] == "default" and fusion[2]["x-vsr-selected-algorithm"] == "fusion"
    server.wait_idle()
    return {"tokens": sum(t for t, _ in results), "latencies": [s for _, s in results],
            "router_tokens": static[1]["usage"]["completion_tokens"] + fusion[1]["usage"]["completion_tokens"]}


def _histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """PromQL's histogram_quantile over cumulative (le, count) pairs, for comparison."""
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def test_promql_answers_what_the_test_caused(scraped):
    url, server, work = scraped
    # the last scrape after the workload: counters at their final values
    # requests: the queued ones, the router's static one, the panel's member, analysis and synthesis
    _wait(lambda: _query(url, "sum(vllm:request_success_total)") == [N_QUEUED + 1 + 3.0],
          "Prometheus never saw the final request count")
    assert work["tokens"] == N_QUEUED * MAX_TOKENS
    assert _query(url, "sum(vllm:generation_tokens_total)") == [work["tokens"] + work["router_tokens"]]
    assert _query(url, 'sum(vllm:request_success_total{finished_reason="length"})') >= [float(N_QUEUED)]
    # queue length and KV usage while the queued requests ran
    assert _query(url, "max_over_time(vllm:num_requests_running[5m])") == [1.0]
    assert _query(url, "max_over_time(vllm:num_requests_waiting[5m])") == [float(N_QUEUED - 1)]
    (kv,) = _query(url, "max_over_time(vllm:kv_cache_usage_perc[5m])")
    assert 0 < kv <= 1
    # output tokens per second, raw and through the shipped recording rule
    (rate,) = _query(url, "sum(rate(vllm:generation_tokens_total[5m]))")
    assert rate > 0
    _wait(lambda: _query(url, "model_name:vllm_generation_tokens:rate1m") != [], "recording rule never evaluated")
    # TTFT p95: PromQL over the scraped buckets is the quantile of what /metrics holds
    text = get(server.url + "/metrics")[1].decode()
    buckets = [(float(line.split('le="')[1].split('"')[0]), float(line.rsplit(" ", 1)[1]))
               for line in text.splitlines() if line.startswith("vllm:time_to_first_token_seconds_bucket")]
    (p95,) = _query(url, "histogram_quantile(0.95, sum by (le) (vllm:time_to_first_token_seconds_bucket))")
    assert p95 == pytest.approx(_histogram_quantile(0.95, buckets), rel=1e-9)
    assert 0 < p95 <= next(le for le, _ in buckets if le >= max(work["latencies"]))
    # the router: one static and one fusion decision, the dead panel member counted once. It is a
    # target of its own, scraped on its own clock: its last scrape after the workload may come later.
    router = {'sum(router_requests_total{algorithm="static"})': [1.0],
              'sum(router_requests_total{algorithm="fusion"})': [1.0],
              'router_panel_member_failures_total{backend="dead"}': [1.0],
              'router_fusion_requests_total{outcome="ok"}': [1.0],
              'count(router_fusion_latency_seconds_count == 1)': [1.0]}
    _wait(lambda: all(_query(url, q) == want for q, want in router.items()),
          "Prometheus never saw the router's final counters")
    for q, want in router.items():
        assert _query(url, q) == want, q


def test_shipped_rules_load_and_evaluate(scraped):
    url, _, _ = scraped
    status, body, _ = get(url + "/api/v1/rules")
    groups = json.loads(body)["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 14 and all(r["health"] == "ok" for r in rules), rules
    firing = {r["name"] for r in rules if r["type"] == "alerting" and r["state"] != "inactive"}
    assert firing == set()   # nothing is down, full or slow after this small workload
