"""benchmarks/throughput_bound.py's model of the engine's schedule: every prompt token and every
output token but the last computed once, one output token a step per request at most, the budget
and max_num_seqs respected, running requests served before waiting ones."""
from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "throughput_bound.py")


@pytest.fixture(scope="module")
def bound():
    spec = importlib.util.spec_from_file_location("throughput_bound", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_schedule_computes_every_token_once(bound):
    prompts, outputs = [5, 30, 7, 12], [3, 1, 6, 2]
    steps = list(bound.schedule(prompts, outputs, budget=16, max_seqs=3))
    assert all(sum(n for _, n, _ in step) <= 16 and len(step) <= 3 for step in steps)
    assert sum(n for step in steps for _, n, _ in step) == sum(p + o - 1 for p, o in zip(prompts, outputs))
    assert sum(emits for step in steps for _, _, emits in step) == sum(outputs)
    assert len(steps) >= max(outputs)
    # step 1: request 0's prompt (5) and the first 11 of request 1's 30; request 2 waits for room
    assert steps[0] == [(0, 5, True), (0, 11, False)]
    # step 2: running first: request 0 decodes, request 1 takes the rest of the budget; 2 still waits
    assert steps[1] == [(5, 1, True), (11, 15, False)]
