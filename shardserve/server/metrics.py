"""Prometheus metrics under vLLM's names (so existing dashboards work) and the per-request log line.

Gauges and the engine's cumulative counters (preemptions, prefix-cache queries and hits, speculative
decoding's drafts and accepted tokens) are read
from the engine when /metrics is scraped; per-request counters and histograms are recorded when a
request finishes, from the engine's timestamps (arrival, first scheduled, first token, finished)
and the times its tokens reached the server.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shardserve.engine.engine import EngineStats
from shardserve.outputs import RequestOutput

request_log = logging.getLogger("shardserve.requests")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineCollector:
    """Values the engine already keeps, read at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self):
        s = self.stats()
        for family, name, doc, value in (
                (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.", s.num_running),
                (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
                (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                 s.kv_cache_usage),
                (CounterMetricFamily, "vllm:num_preemptions", "Preemptions (requests evicted to free KV blocks).",
                 s.num_preemptions),
                (CounterMetricFamily, "vllm:prefix_cache_queries", "Tokens looked up in the prefix cache.",
                 s.prefix_cache_queries),
                (CounterMetricFamily, "vllm:prefix_cache_hits", "Tokens found in the prefix cache.",
                 s.prefix_cache_hits)):
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric
        if s.spec_decoding is not None:
            yield from self._spec_decoding(s.spec_decoding)

    def _spec_decoding(self, spec):
        """Speculative decoding's acceptance counters, as vLLM names them."""
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Verification steps of one request that carried drafts.",
                 spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)):
            metric = CounterMetricFamily(name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft (0 = first).",
                                      labels=["model_name", "position"])
        for position, value in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([self.model_name, str(position)], value)
        yield per_pos


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name))
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=reg)
        self.request_success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                       labels + ["finished_reason"], registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", labels,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled.", labels,
                               buckets=_LATENCY_BUCKETS, registry=reg)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", labels,
                                    buckets=_TOKEN_BUCKETS, registry=reg)
        self.req_generation = Histogram("vllm:request_generation_tokens", "Generated tokens per request.", labels,
                                        buckets=_TOKEN_BUCKETS, registry=reg)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestRecord:
    """Follows one request's outputs to record its metrics and log line once it ends."""

    def __init__(self, metrics: ServerMetrics, request_id: str, prompt: str | None, max_log_len: int | None) -> None:
        self.metrics, self.request_id = metrics, request_id
        self.prompt, self.max_log_len = prompt, max_log_len
        self.last: RequestOutput | None = None
        self._seen_tokens = 0
        self._last_token_at: float | None = None
        self.itls: list[float] = []

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        total = sum(len(c.token_ids) for c in out.outputs)
        new = total - self._seen_tokens
        if new > 0:
            if self._last_token_at is not None:
                self.itls.extend([(now - self._last_token_at) / new] * new)
            self._last_token_at, self._seen_tokens = now, total
        self.last = out

    def finish(self, finish_reason: str) -> None:
        """Record counters, histograms and the log line. finish_reason: stop, length or abort."""
        m, labels, out = self.metrics, (self.metrics.model_name,), self.last
        prompt_tokens = len(out.prompt_token_ids) if out else 0
        completion_tokens = sum(len(c.token_ids) for c in out.outputs) if out else 0
        times = out.metrics if out else {}
        now = time.monotonic()
        arrival = times.get("arrival_time", now)
        e2e = times.get("finished_time", now) - arrival
        ttft = times["first_token_time"] - arrival if "first_token_time" in times else None
        queue = times["first_scheduled_time"] - arrival if "first_scheduled_time" in times else None
        m.request_success.labels(*labels, finish_reason).inc()
        m.prompt_tokens.labels(*labels).inc(prompt_tokens)
        m.generation_tokens.labels(*labels).inc(completion_tokens)
        m.req_prompt.labels(*labels).observe(prompt_tokens)
        m.req_generation.labels(*labels).observe(completion_tokens)
        m.e2e.labels(*labels).observe(e2e)
        if ttft is not None:
            m.ttft.labels(*labels).observe(ttft)
        if queue is not None:
            m.queue.labels(*labels).observe(queue)
        for gap in self.itls:
            m.itl.labels(*labels).observe(gap)
        tpot = (e2e - ttft) / (completion_tokens - 1) if ttft is not None and completion_tokens > 1 else None
        prompt = self.prompt if self.max_log_len is None or self.prompt is None else self.prompt[:self.max_log_len]
        request_log.info(json.dumps({
            "event": "request_finished", "request_id": self.request_id, "model": m.model_name,
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "ttft_s": _round(ttft), "tpot_s": _round(tpot), "e2e_s": _round(e2e), "queue_s": _round(queue),
            "finish_reason": finish_reason, "prompt": prompt}))


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
