"""Load, soak and overload against a live `shardserve serve` (issue 29).

A mix of requests from CONCURRENCY clients for DURATION seconds: streaming chat, non-streaming
completions, streams the client aborts after the first chunk, token-id prompts a few tokens short of
the context limit, and n > 1. Then a burst far over `--max-queue-len`. It records p50/p99 TTFT (the
streams), statuses and client errors by request kind, the server's resident memory at start and end,
and checks the end state: every request sent was answered (200), refused with a clear status (429
with Retry-After, 400, 503) or aborted by the client, none lost; the server then answers, with KV
usage 0 and nothing running or waiting.

    python benchmarks/load_soak.py --duration 300 --concurrency 16 [--save-result results.json]

starts the embedded SmolLM2 itself (`--url` targets a running server; give `--pid` for its memory).
tests/hardening/test_load.py runs it for ~30 s in CI.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from typing import Any

import aiohttp

KINDS = ("stream", "completion", "abort", "long_prompt", "n3")
REFUSALS = {400, 413, 429, 503}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def _rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    import psutil
    proc = psutil.Process(pid)
    return round(sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20, 1)


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name = key.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


class Load:
    def __init__(self, url: str, model: str, max_model_len: int, seed: int) -> None:
        self.url, self.model, self.max_model_len = url, model, max_model_len
        self.rng = random.Random(seed)
        self.sent: Counter = Counter()
        self.outcomes: Counter = Counter()       # "kind:200", "kind:429", "kind:aborted", "kind:ClientError"
        self.ttft: list[float] = []
        self.retry_after_missing = 0

    def _body(self, kind: str) -> tuple[str, dict[str, Any]]:
        words = " ".join(self.rng.choice(["tea", "river", "stone", "cloud", "seven", "blue"]) for _ in range(12))
        if kind in ("stream", "abort"):
            return "/v1/chat/completions", {"model": self.model, "stream": True, "max_tokens": 16,
                                            "messages": [{"role": "user", "content": f"Tell a story: {words}"}]}
        if kind == "completion":
            return "/v1/completions", {"model": self.model, "prompt": words, "max_tokens": 16}
        if kind == "long_prompt":   # token ids, 8 short of the context limit (as many as fit with 4 new)
            ids = [self.rng.randrange(100, 20000) for _ in range(self.max_model_len - 8)]
            return "/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": 4}
        return "/v1/chat/completions", {"model": self.model, "n": 3, "max_tokens": 8, "temperature": 1.0,
                                        "messages": [{"role": "user", "content": words}]}

    async def one(self, session: aiohttp.ClientSession, kind: str) -> None:
        path, body = self._body(kind)
        self.sent[kind] += 1
        start = time.perf_counter()
        try:
            async with session.post(self.url + path, json=body) as r:
                if r.status == 429 and "Retry-After" not in r.headers:
                    self.retry_after_missing += 1
                if r.status != 200 or not body.get("stream"):
                    await r.read()
                    self.outcomes[f"{kind}:{r.status}"] += 1
                    if r.status == 429:   # a well-behaved client waits as told
                        await asyncio.sleep(float(r.headers.get("Retry-After", 1)))
                    return
                first = True
                async for line in r.content:
                    if not line.startswith(b"data:"):
                        continue
                    if first:
                        self.ttft.append(time.perf_counter() - start)
                        first = False
                        if kind == "abort":
                            r.close()   # the client goes away mid-stream
                            self.outcomes[f"{kind}:aborted"] += 1
                            return
                    if b'"error"' in line:
                        self.outcomes[f"{kind}:stream_error"] += 1
                        return
                self.outcomes[f"{kind}:200"] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.outcomes[f"{kind}:{type(e).__name__}"] += 1

    async def run(self, duration_s: float, concurrency: int) -> None:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            deadline = time.monotonic() + duration_s

            async def client() -> None:
                while time.monotonic() < deadline:
                    await self.one(session, self.rng.choice(KINDS))
            await asyncio.gather(*(client() for _ in range(concurrency)))

    async def burst(self, n: int) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await asyncio.gather(*(self.one(session, "completion") for _ in range(n)))


async def settle(url: str, timeout_s: float = 60) -> dict[str, float]:
    """The server's gauges once it is idle (or at the deadline)."""
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + timeout_s
        while True:
            m = await _metrics(session, url)
            idle = (m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
                    and m["vllm:kv_cache_usage_perc"] == 0)
            if idle or time.monotonic() > deadline:
                async with session.get(url + "/health") as r:
                    m["health_status"] = r.status
                return m
            await asyncio.sleep(0.2)


def soak(url: str, model: str, max_model_len: int, duration_s: float, concurrency: int, burst: int,
         pid: int | None, seed: int = 0) -> dict[str, Any]:
    load = Load(url, model, max_model_len, seed)
    rss_start = _rss_mb(pid)
    t0 = time.perf_counter()
    asyncio.run(load.run(duration_s, concurrency))
    soak_s = time.perf_counter() - t0
    soak_outcomes = dict(load.outcomes)
    load.outcomes.clear()
    asyncio.run(load.burst(burst))
    burst_outcomes = dict(load.outcomes)
    end = asyncio.run(settle(url))
    sent = sum(load.sent.values())
    counted = sum(soak_outcomes.values()) + sum(burst_outcomes.values())
    return {
        "duration_s": round(soak_s, 1), "concurrency": concurrency, "sent_by_kind": dict(load.sent),
        "sent": sent, "counted": counted, "soak_outcomes": soak_outcomes, "burst_size": burst,
        "burst_outcomes": burst_outcomes, "retry_after_missing": load.retry_after_missing,
        "ttft_p50_s": _percentile(load.ttft, 50), "ttft_p99_s": _percentile(load.ttft, 99),
        "rss_start_mb": rss_start, "rss_end_mb": _rss_mb(pid),
        "end": {k: end[k] for k in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                    "vllm:kv_cache_usage_perc", "health_status")},
    }


def check(result: dict[str, Any]) -> list[str]:
    """What is wrong with a run's result (empty: nothing)."""
    problems = []
    if result["sent"] != result["counted"]:
        problems.append(f"{result['sent']} sent but {result['counted']} accounted for")
    for phase in ("soak_outcomes", "burst_outcomes"):
        for key, count in result[phase].items():
            kind, outcome = key.split(":")
            ok = outcome in ("200", "aborted") or (outcome.isdigit() and int(outcome) in REFUSALS)
            if not ok:
                problems.append(f"{phase}: {count} x {key}")
    if result["retry_after_missing"]:
        problems.append(f"{result['retry_after_missing']} 429s without Retry-After")
    end = result["end"]
    if end["health_status"] != 200 or end["vllm:num_requests_running"] or end["vllm:num_requests_waiting"] \
            or end["vllm:kv_cache_usage_perc"]:
        problems.append(f"not idle at the end: {end}")
    return problems


def start_server(max_model_len: int, max_queue_len: int, max_num_seqs: int, log_path: str) -> tuple[Any, str]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.server.server_process import ServerProcess
    srv = ServerProcess(["--max-model-len", str(max_model_len), "--kv-cache-memory", "128MiB",
                         "--max-num-seqs", str(max_num_seqs), "--max-queue-len", str(max_queue_len)], log_path)
    return srv, srv.url


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start the embedded model)")
    p.add_argument("--pid", type=int, default=None, help="the running server's pid, for its memory")
    p.add_argument("--model", default=None)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-queue-len", type=int, default=8)
    p.add_argument("--duration", type=float, default=300)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--burst", type=int, default=48)
    p.add_argument("--save-result", default=None)
    args = p.parse_args()
    srv = None
    if args.url is None:
        srv, url = start_server(args.max_model_len, args.max_queue_len, args.max_num_seqs,
                                os.path.join(tempfile.mkdtemp(), "server.log"))
        pid = srv.proc.pid
    else:
        url, pid = args.url, args.pid
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            model = args.model or json.loads(r.read())["data"][0]["id"]
        result = soak(url, model, args.max_model_len, args.duration, args.concurrency, args.burst, pid)
    finally:
        if srv is not None:
            srv.stop()
    result["problems"] = check(result)
    print(json.dumps(result, indent=2))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
