"""layers/cpu_path.py: every CPU dispatch decision follows its switch, whatever CPU runs the test,
and the start-up line names the path and why."""
from __future__ import annotations

import logging

import pytest
import torch

from shardserve.kernels.cpu import cpu_ops
from shardserve.layers import cpu_path


@pytest.mark.parametrize("switch,want", [("1", torch.bfloat16), ("0", torch.float32)])
def test_the_native_half_switch_forces_either_way(monkeypatch, switch, want):
    monkeypatch.setenv("SHARDSERVE_CPU_NATIVE_HALF", switch)
    path = cpu_path.choose_cpu_path(torch.bfloat16)
    assert path.compute_dtype == want
    assert f"SHARDSERVE_CPU_NATIVE_HALF={switch}" in path.reason


def test_unset_bf16_takes_the_native_kernels_where_they_build(monkeypatch):
    monkeypatch.delenv("SHARDSERVE_CPU_NATIVE_HALF", raising=False)
    path = cpu_path.choose_cpu_path(torch.bfloat16)
    if cpu_ops.available():
        assert path.compute_dtype == torch.float32 and path.native_kernels
    else:   # plain torch: native bf16 only on a CPU with bf16 units
        assert path.compute_dtype == (torch.bfloat16 if cpu_path.has_half_units(torch.bfloat16) else torch.float32)


def test_without_kernels_a_cpu_with_bf16_units_computes_in_bf16(monkeypatch):
    monkeypatch.delenv("SHARDSERVE_CPU_NATIVE_HALF", raising=False)
    monkeypatch.setattr(cpu_path.cpu_ops, "available", lambda: False)
    for units, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(cpu_path, "has_half_units", lambda dtype, units=units: units)
        assert cpu_path.choose_cpu_path(torch.bfloat16).compute_dtype == want


def test_fp32_stays_fp32_and_a_bad_switch_is_refused(monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CPU_NATIVE_HALF", "1")
    assert cpu_path.choose_cpu_path(torch.float32).compute_dtype == torch.float32
    monkeypatch.setenv("SHARDSERVE_CPU_NATIVE_HALF", "yes")
    with pytest.raises(ValueError, match="use 1 .* or 0"):
        cpu_path.choose_cpu_path(torch.bfloat16)


def test_the_engine_logs_one_line_naming_the_path(monkeypatch):
    from shardserve.engine.args import _compute_dtype
    monkeypatch.setenv("SHARDSERVE_CPU_NATIVE_HALF", "1")
    log = logging.getLogger("shardserve")   # may not propagate (LLM sets its own handler)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        assert _compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    lines = [r.getMessage() for r in records if r.getMessage().startswith("CPU path:")]
    assert len(lines) == 1 and "native bf16 math" in lines[0] and "SHARDSERVE_CPU_NATIVE_HALF=1" in lines[0]
