"""Locust (headless) against a live `shardserve serve`, with benchmarks/load_soak.py's mix (issue 29):
streaming chat, non-streaming completions, streams the client drops after the first chunk, token-id
prompts 8 tokens short of the context, chat with n=3; a 429 makes a user wait its Retry-After.
Locust's tables give latency per kind and failures by kind and reason; at the end this file adds
TTFT p50/p99, outcomes by kind (every request sent is accounted for), the server's memory at start
and end and its end state (idle, healthy), and exits non-zero if any of that is wrong.

    pip install locust
    shardserve serve --max-model-len 512 --kv-cache-memory 128MiB --max-num-seqs 8 --max-queue-len 8 &
    locust -f benchmarks/locustfile.py --headless -u 16 -r 16 -t 180s --host http://127.0.0.1:8000 \\
        --server-pid $! [--max-model-len 512] [--summary-json out.json]
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import Counter
from typing import Any

from locust import HttpUser, events, task

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_soak import KINDS, REFUSALS, Load, _percentile, _rss_mb  # noqa: E402  (the same mix, not a copy)

STATE: dict[str, Any] = {"sent": Counter(), "outcomes": Counter(), "ttft": [], "retry_after_missing": 0}


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    parser.add_argument("--server-pid", type=int, default=None, help="the server's pid, for its memory")
    parser.add_argument("--max-model-len", type=int, default=512, help="the server's --max-model-len")
    parser.add_argument("--summary-json", default=None, help="write the end summary here")


def _get(url: str) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@events.test_start.add_listener
def _start(environment, **_) -> None:
    opts = environment.parsed_options
    STATE["model"] = json.loads(_get(environment.host + "/v1/models")[1])["data"][0]["id"]
    STATE["rss_start_mb"] = _rss_mb(opts.server_pid)
    STATE["started"] = time.monotonic()


class Client(HttpUser):
    """A closed-loop client like load_soak's: one request after another, no think time."""

    def on_start(self) -> None:
        self.load = Load(self.host, STATE["model"], self.environment.parsed_options.max_model_len,
                         seed=random.randrange(1 << 30))

    @task
    def one(self) -> None:
        kind = self.load.rng.choice(KINDS)
        path, body = self.load._body(kind)
        STATE["sent"][kind] += 1
        start = time.perf_counter()
        with self.client.post(path, json=body, name=kind, stream=bool(body.get("stream")), timeout=120,
                              catch_response=True) as r:
            if r.status_code != 200:
                outcome = str(r.status_code) if r.status_code else type(r.error).__name__
                STATE["outcomes"][f"{kind}:{outcome}"] += 1
                if r.status_code == 429:
                    STATE["retry_after_missing"] += "Retry-After" not in r.headers
                    r.failure("429 refused (--max-queue-len)")   # shown apart from real errors by reason
                    time.sleep(float(r.headers.get("Retry-After", 1)))   # gevent-patched: yields
                else:
                    r.failure(f"{outcome}: {r.text[:100] if r.status_code else r.error}")
                return
            if not body.get("stream"):
                STATE["outcomes"][f"{kind}:200"] += 1
                return
            first = True
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                if first:
                    STATE["ttft"].append(time.perf_counter() - start)
                    first = False
                    if kind == "abort":   # the client goes away mid-stream
                        STATE["outcomes"][f"{kind}:aborted"] += 1
                        r.success()
                        return
                if b'"error"' in line:
                    STATE["outcomes"][f"{kind}:stream_error"] += 1
                    r.failure("error event in the stream")
                    return
            STATE["outcomes"][f"{kind}:200"] += 1


@events.quitting.add_listener
def _finish(environment, **_) -> None:
    """The end summary and state; a lost request, a 5xx or a busy server at the end fail the run."""
    host = environment.host
    deadline = time.monotonic() + 60
    while True:   # requests cut by the end of the run are aborted: wait for the server to settle
        metrics = _metrics(_get(host + "/metrics")[1].decode())
        idle = not (metrics["vllm:num_requests_running"] or metrics["vllm:num_requests_waiting"]
                    or metrics["vllm:kv_cache_usage_perc"])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    sent, outcomes = sum(STATE["sent"].values()), STATE["outcomes"]
    problems = [f"{n} x {k}" for k, n in outcomes.items()
                if k.split(":")[1] not in ("200", "aborted") and not (k.split(":")[1].isdigit()
                                                                    and int(k.split(":")[1]) in REFUSALS)]
    # Requests in flight when locust stopped its users were cut by it (greenlets killed), not lost.
    cut = sent - sum(outcomes.values())
    if STATE["retry_after_missing"]:
        problems.append(f"{STATE['retry_after_missing']} 429s without Retry-After")
    health = _get(host + "/health")[0]
    if health != 200 or not idle:
        problems.append(f"not idle at the end: health {health}, {metrics}")
    summary = {"duration_s": round(time.monotonic() - STATE["started"], 1), "users": environment.runner.user_count
               if environment.runner else None, "sent": sent, "cut_by_stop": cut,
               "sent_by_kind": dict(STATE["sent"]), "outcomes": dict(sorted(outcomes.items())),
               "ttft_p50_s": _percentile(STATE["ttft"], 50), "ttft_p99_s": _percentile(STATE["ttft"], 99),
               "rss_start_mb": STATE.get("rss_start_mb"),
               "rss_end_mb": _rss_mb(environment.parsed_options.server_pid), "health": health,
               "end": {k: metrics[k] for k in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                               "vllm:kv_cache_usage_perc")}, "problems": problems}
    print(json.dumps(summary, indent=2))
    if environment.parsed_options.summary_json:
        with open(environment.parsed_options.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
    # Locust alone would exit 1 on any failure; 429s are refusals, so the problems decide.
    environment.process_exit_code = 1 if problems else 0


def _metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key.split("{")[0]] = out.get(key.split("{")[0], 0.0) + float(value)
    return out
