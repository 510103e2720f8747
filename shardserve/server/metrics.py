"""Prometheus metrics under vLLM's names (so existing dashboards work) and the per-request log line.

Gauges and the engine's cumulative counters (preemptions, prefix-cache queries and hits, speculative
decoding's drafts and accepted tokens) are read from the engine when /metrics is scraped; tokens per
engine step are observed as each step is scheduled; per-request counters and histograms are recorded
when a request finishes, from the engine's timestamps (arrival, first scheduled, first token,
finished) and the times its tokens reached the server. The names vLLM renamed are exported under
their old names too (`DEPRECATED_ALIASES`), so dashboards and alerts written against either work.
No `*_created` series, as in vLLM.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, is_dataclass
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shardserve.engine.engine import EngineStats
from shardserve.outputs import RequestOutput
from shardserve.sampling_params import SamplingParams
from shardserve.server import tracing
from shardserve.server.stat_logger import StatLogger

disable_created_metrics()   # process-wide: vLLM turns them off too; they only clutter dashboards

request_log = logging.getLogger("shardserve.requests")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_N_BUCKETS = (1, 2, 5, 10, 20)

# old vLLM name -> the current one it duplicates (same values, same type)
DEPRECATED_ALIASES = {
    "vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries": "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits": "vllm:prefix_cache_hits",
    "vllm:time_per_output_token_seconds": "vllm:inter_token_latency_seconds",
}


class _EngineCollector:
    """Values the engine already keeps, read at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, cache_config: Any = None) -> None:
        self.stats, self.model_name, self.cache_config = stats, model_name, cache_config

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
            for metric_name in [name] + [old for old, new in DEPRECATED_ALIASES.items() if new == name]:
                doc_ = doc if metric_name == name else f"Deprecated vLLM name of {name}: {doc}"
                metric = family(metric_name, doc_, labels=["model_name"])
                metric.add_metric([self.model_name], value)
                yield metric
        if self.cache_config is not None and is_dataclass(self.cache_config):
            fields = {k: str(v) for k, v in asdict(self.cache_config).items()}
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config (value 1).",
                                     labels=list(fields))
            info.add_metric(list(fields.values()), 1)
            yield info
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
    def __init__(self, stats: Callable[[], EngineStats], model_name: str, cache_config: Any = None) -> None:
        self.model_name = model_name
        self.stat_logger: StatLogger | None = None   # the periodic log line (stat_logger.py), unless disabled
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name, cache_config))
        labels = ["model_name"]
        reg = self.registry

        def histogram(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=reg)
        self.request_success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                       labels + ["finished_reason"], registry=reg)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.itl_old = histogram("vllm:time_per_output_token_seconds",
                                 "Deprecated vLLM name of vllm:inter_token_latency_seconds.")
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: (e2e - TTFT) / (output tokens - 1).")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.")
        self.queue = histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled.")
        self.inference = histogram("vllm:request_inference_time_seconds", "First scheduled to finished.")
        self.prefill = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to finished.")
        self.req_prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.req_generation = histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                        _TOKEN_BUCKETS)
        self.req_max_generation = histogram("vllm:request_max_num_generation_tokens",
                                            "Most tokens generated by one sequence of a request.", _TOKEN_BUCKETS)
        self.params_n = histogram("vllm:request_params_n", "The n request parameter.", _N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens request parameter.",
                                           _TOKEN_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens scheduled per engine step.",
                                          _TOKEN_BUCKETS)

    def observe_steps(self, engine: Any) -> None:
        """Observe every engine step's scheduled token count (`vllm:iteration_tokens_total`) by
        wrapping each scheduler's schedule(); the engine keeps no per-step history to read."""
        child = self.iteration_tokens.labels(self.model_name)
        inner = getattr(engine, "engine", engine)   # AsyncLLMEngine -> LLMEngine | DataParallelEngine
        for replica in getattr(inner, "replicas", None) or [inner]:
            for scheduler in getattr(replica, "schedulers", []):
                def schedule(_schedule=scheduler.schedule):
                    out = _schedule()
                    if out.total_num_scheduled_tokens:
                        child.observe(out.total_num_scheduled_tokens)
                    return out
                scheduler.schedule = schedule

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestRecord:
    """Follows one request's outputs to record its metrics, log line and trace span once it ends."""

    def __init__(self, metrics: ServerMetrics, request_id: str, prompt: str | None, max_log_len: int | None,
                 params: SamplingParams | None = None, headers: Any = None) -> None:
        self.metrics, self.request_id = metrics, request_id
        self.prompt, self.max_log_len = prompt, max_log_len
        self.params, self.headers = params, headers   # headers: the HTTP request's, for trace context
        self.last: RequestOutput | None = None
        self._seen_tokens = 0
        self._last_token_at: float | None = None
        self.itls: list[float] = []

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        total = sum(len(c.token_ids) for c in out.outputs)
        new = total - self._seen_tokens
        if self.metrics.stat_logger is not None:
            prompt = len(out.prompt_token_ids or ()) if self.last is None else 0
            self.metrics.stat_logger.record(prompt, max(new, 0))
        if new > 0:
            if self._last_token_at is not None:
                self.itls.extend([(now - self._last_token_at) / new] * new)
            self._last_token_at, self._seen_tokens = now, total
        self.last = out

    def finish(self, finish_reason: str) -> None:
        """Record counters, histograms, the log line and the span. finish_reason: stop, length or abort."""
        m, labels, out = self.metrics, (self.metrics.model_name,), self.last
        prompt_tokens = len(out.prompt_token_ids) if out else 0
        per_seq = [len(c.token_ids) for c in out.outputs] if out else []
        completion_tokens = sum(per_seq)
        times = out.metrics if out else {}
        now = time.monotonic()
        arrival = times.get("arrival_time", now)
        finished = times.get("finished_time", now)
        e2e = finished - arrival
        first_token, scheduled = times.get("first_token_time"), times.get("first_scheduled_time")
        ttft = None if first_token is None else first_token - arrival
        queue = None if scheduled is None else scheduled - arrival
        tpot = (e2e - ttft) / (completion_tokens - 1) if ttft is not None and completion_tokens > 1 else None
        m.request_success.labels(*labels, finish_reason).inc()
        m.prompt_tokens.labels(*labels).inc(prompt_tokens)
        m.generation_tokens.labels(*labels).inc(completion_tokens)
        observations = [(m.req_prompt, prompt_tokens), (m.req_generation, completion_tokens),
                        (m.req_max_generation, max(per_seq, default=0)), (m.e2e, e2e), (m.ttft, ttft),
                        (m.queue, queue), (m.tpot, tpot)]
        if scheduled is not None:
            observations.append((m.inference, finished - scheduled))
            if first_token is not None:
                observations += [(m.prefill, first_token - scheduled), (m.decode, finished - first_token)]
        if self.params is not None:
            observations += [(m.params_n, self.params.n), (m.params_max_tokens, self.params.max_tokens)]
        for histogram, value in observations:
            if value is not None:
                histogram.labels(*labels).observe(value)
        for gap in self.itls:
            m.itl.labels(*labels).observe(gap)
            m.itl_old.labels(*labels).observe(gap)
        trace_id = tracing.request_span(
            self.headers, self.request_id, m.model_name, arrival, finished,
            {"gen_ai.usage.prompt_tokens": prompt_tokens, "gen_ai.usage.completion_tokens": completion_tokens,
             "gen_ai.usage.num_sequences": len(per_seq), "gen_ai.latency.time_in_queue": queue,
             "gen_ai.latency.time_to_first_token": ttft, "gen_ai.latency.e2e": e2e,
             "gen_ai.latency.time_in_model_prefill": None if queue is None or ttft is None else ttft - queue,
             "gen_ai.latency.time_in_model_decode": None if ttft is None else e2e - ttft,
             **_param_attributes(self.params)})
        # The prompt only when asked (--max-log-len N: its first N characters); never by default.
        prompt = self.prompt[:self.max_log_len] if self.max_log_len and self.prompt is not None else None
        line = {"event": "request_finished", "request_id": self.request_id, "model": m.model_name,
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "ttft_s": _round(ttft), "tpot_s": _round(tpot), "e2e_s": _round(e2e), "queue_s": _round(queue),
                "finish_reason": finish_reason, "prompt": prompt}
        if trace_id is not None:
            line["trace_id"] = trace_id
        request_log.info(json.dumps(line))


def _param_attributes(params: SamplingParams | None) -> dict[str, Any]:
    if params is None:
        return {}
    return {"gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p, "gen_ai.request.n": params.n}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
