"""Router overhead (issue 5), measured in one run on this machine:

1. Single-model route: the same 1-token chat request sent N times straight to a `shardserve serve`
   backend and N times through `shardserve router` to that backend; p50/p99 of each and the
   difference (what the router adds).
2. Fusion: a 2-member panel plus a judge (all the same tiny-model server). Fusion latency beside the
   slowest panel member plus the judge's two calls (analysis, synthesis), both read from the trace
   and the router's backend-latency histogram: the rest is the router's own fusion overhead.

    .venv/bin/python benchmarks/router_overhead.py [--requests 500] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve.bench.report import report  # noqa: E402
from tests.server.server_process import ServerProcess, get, post  # noqa: E402
from tests.tiny_models import make_tiny_checkpoint  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def timed(url: str, body: dict, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        status, data, _ = post(url, body)
        times.append((time.perf_counter() - start) * 1000)
        assert status == 200, data
    return times


def judge_seconds(router_url: str) -> float:
    text = get(router_url + "/metrics")[1].decode()
    m = re.search(r'router_backend_latency_seconds_sum\{backend="judge"\} ([0-9.e+-]+)', text)
    return float(m.group(1)) if m else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--fusion-requests", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    tmp = tempfile.mkdtemp()
    ckpt = make_tiny_checkpoint(os.path.join(tmp, "ckpt"), "llama")
    backend = ServerProcess([ckpt, "--kv-cache-memory", "16MiB", "--served-model-name", "tiny"],
                            os.path.join(tmp, "backend.log"))
    url = backend.url + "/v1"
    config = {"router": {"backends": [{"id": i, "type": "shardserve", "base_url": url, "model": "tiny"}
                                      for i in ("tiny", "a", "b", "judge")],
                         "decisions": [{"id": "panel", "algorithm": {"type": "fusion", "analysis_models": ["a", "b"],
                                                                     "judge_model": "judge"},
                                        "signals": [{"type": "keyword", "keywords": ["panel"]}]}]}}
    with open(os.path.join(tmp, "router.yaml"), "w") as f:
        yaml.safe_dump(config, f)
    router = ServerProcess(["--config", os.path.join(tmp, "router.yaml")], os.path.join(tmp, "router.log"),
                           command="router")
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
        timed(backend.url + "/v1/chat/completions", body, 20)   # warm-up both paths
        timed(router.url + "/v1/chat/completions", body, 20)
        direct, routed = [], []
        for _ in range(args.requests // 50):   # interleave so drift hits both alike
            direct += timed(backend.url + "/v1/chat/completions", body, 50)
            routed += timed(router.url + "/v1/chat/completions", body, 50)
        single = {"direct_p50_ms": percentile(direct, 50), "direct_p99_ms": percentile(direct, 99),
                  "routed_p50_ms": percentile(routed, 50), "routed_p99_ms": percentile(routed, 99)}
        single["added_p50_ms"] = single["routed_p50_ms"] - single["direct_p50_ms"]
        single["added_p99_ms"] = single["routed_p99_ms"] - single["direct_p99_ms"]

        fusion_body = {"model": "vllm-sr/auto", "messages": [{"role": "user", "content": "ask the panel"}],
                       "max_tokens": 16, "temperature": 0}
        totals, slowest, judge = [], [], []
        for _ in range(args.fusion_requests):
            j0 = judge_seconds(router.url)
            start = time.perf_counter()
            status, data, _ = post(router.url + "/v1/chat/completions", fusion_body)
            totals.append((time.perf_counter() - start) * 1000)
            assert status == 200, data
            slowest.append(max(m["latency_ms"] for m in data["fusion_trace"]["panel_results"]))
            judge.append((judge_seconds(router.url) - j0) * 1000)
        fusion = {"fusion_p50_ms": statistics.median(totals), "slowest_member_p50_ms": statistics.median(slowest),
                  "judge_two_calls_p50_ms": statistics.median(judge),
                  "overhead_p50_ms": statistics.median([t - s - j for t, s, j in zip(totals, slowest, judge)])}
        result = {"requests": args.requests, "single_route": single, "fusion": fusion}
        report(result, args.json)
    finally:
        router.stop()
        backend.stop()


if __name__ == "__main__":
    main()
