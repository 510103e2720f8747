"""vLLM's periodic engine line in the server's log, every `SHARDSERVE_LOG_STATS_INTERVAL` seconds (10
by default, as VLLM_LOG_STATS_INTERVAL) while anything happened, off with `--disable-log-stats`:

    Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 96.0 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 45.0%

As in vLLM, a request's prompt tokens count in the interval where its first token came out, and the
prefix-cache hit rate is that of the lookups made in the interval (the engine keeps the counts)."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable

from shardserve.engine.engine import EngineStats

logger = logging.getLogger("shardserve")


def interval_s() -> float:
    value = os.environ.get("SHARDSERVE_LOG_STATS_INTERVAL", "10")
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"SHARDSERVE_LOG_STATS_INTERVAL={value!r}: expected seconds > 0")
    return seconds


class StatLogger:
    def __init__(self, stats: Callable[[], EngineStats], interval: float) -> None:
        self.stats, self.interval = stats, interval
        self.prompt_tokens = self.generation_tokens = 0
        self._since = time.monotonic()
        first = stats()
        self._queries, self._hits = first.prefix_cache_queries, first.prefix_cache_hits

    def record(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Tokens a request's latest output brought: its prompt's on its first output, its new ones."""
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens

    def line(self) -> str | None:
        """The interval's line, and a new interval; None where nothing ran, waited or came out."""
        now, s = time.monotonic(), self.stats()
        elapsed = max(now - self._since, 1e-9)
        queries, hits = s.prefix_cache_queries - self._queries, s.prefix_cache_hits - self._hits
        busy = self.prompt_tokens or self.generation_tokens or s.num_running or s.num_waiting
        text = (f"Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, Avg generation throughput: "
                f"{self.generation_tokens / elapsed:.1f} tokens/s, Running: {s.num_running} reqs, Waiting: "
                f"{s.num_waiting} reqs, KV cache usage: {100 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: "
                f"{100 * hits / queries if queries else 0.0:.1f}%")
        self.prompt_tokens = self.generation_tokens = 0
        self._since, self._queries, self._hits = now, s.prefix_cache_queries, s.prefix_cache_hits
        return text if busy else None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            text = self.line()
            if text is not None:
                logger.info(text)
