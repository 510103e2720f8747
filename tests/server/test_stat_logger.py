"""server/stat_logger.py's line on its own: throughputs over the interval, the engine's gauges, the
interval's prefix-cache hit rate, and nothing for an idle interval."""
from __future__ import annotations

import pytest

from shardserve.engine.engine import EngineStats
from shardserve.server import stat_logger
from shardserve.server.stat_logger import StatLogger


def test_line_counts_the_interval_only(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(stat_logger.time, "monotonic", lambda: clock[0])
    stats = [EngineStats(0, 0, 0.0, prefix_cache_queries=50, prefix_cache_hits=10, num_preemptions=0)]
    log = StatLogger(lambda: stats[0], interval=2.0)
    clock[0] = 102.0
    assert log.line() is None   # idle: no line
    log.record(300, 1)          # a request's first output: its prompt and first token
    log.record(0, 39)
    stats[0] = EngineStats(3, 1, 0.25, prefix_cache_queries=250, prefix_cache_hits=160, num_preemptions=0)
    clock[0] = 106.0
    assert log.line() == ("Avg prompt throughput: 75.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
                          "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 75.0%")
    clock[0] = 108.0   # still running, nothing new: a line (the engine is busy), zero throughput
    assert log.line().startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
                                 "Running: 3 reqs")


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_interval_must_be_positive_seconds(monkeypatch, value):
    monkeypatch.setenv("SHARDSERVE_LOG_STATS_INTERVAL", value)
    with pytest.raises(ValueError, match="SHARDSERVE_LOG_STATS_INTERVAL"):
        stat_logger.interval_s()
