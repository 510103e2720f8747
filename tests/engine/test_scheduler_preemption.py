"""Scheduler preemption when the KV pool runs dry, and the priority policy (admission, batch order,
the least urgent preempted first), driven with fake model outputs (tests/engine/scheduler_harness.py)."""
from __future__ import annotations

import pytest

from shardserve.config import SchedulerConfig
from shardserve.engine.request import RequestStatus
from tests.engine.scheduler_harness import BS, Harness, free_blocks_all_returned, prompt


# ---- preemption ---------------------------------------------------------------------------
def test_preemption_when_blocks_run_out():
    # 6 usable blocks; two 8-token prompts (2 blocks each) grow until a 4th block is needed.
    h = Harness(num_blocks=7, max_num_batched_tokens=32, prefix_caching=False)
    a = h.add("a", prompt(1, 8), max_tokens=16)   # 24 tokens: each alone fits in the pool
    b = h.add("b", prompt(100, 8), max_tokens=16)
    while not h.sched.num_preemptions:
        out, _ = h.step()
        assert a.status == RequestStatus.RUNNING
    # b, the most recently admitted, is the victim; a kept running in that step.
    assert h.sched.num_preemptions == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.status == RequestStatus.PREEMPTED
    assert "b" in out.finished_req_ids and "b" not in out.num_scheduled_tokens
    assert out.num_scheduled_tokens == {"a": 1}
    assert list(h.sched.waiting) == [b] and h.sched.running == [a]
    assert "b" not in h.sched.kv.requests and b.num_computed_tokens == 0
    assert h.sched.kv.num_free_blocks == 6 - 4       # a holds 4 blocks, b's were freed
    b_tokens = b.all_token_ids
    assert b.num_output_tokens == 5
    # A newcomer queues behind the preempted request.
    h.add("c", prompt(200, 3), max_tokens=1)
    assert [r.request_id for r in h.sched.waiting] == ["b", "c"]
    # Make room: once a finishes, b comes back as a new request carrying its outputs.
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out, _ = h.step()
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert new["b"].token_ids == b_tokens and new["b"].num_prompt_tokens == 8
    assert new["b"].num_computed_tokens == 0
    assert out.num_scheduled_tokens["b"] == 13
    assert b.status == RequestStatus.RUNNING and b.num_output_tokens == 6   # resumed where it was
    h.run_until_done()
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 16
    assert free_blocks_all_returned(h)


def test_preempted_request_reuses_its_cached_prefix():
    h = Harness(num_blocks=7, max_num_batched_tokens=32, prefix_caching=True)
    a = h.add("a", prompt(1, 8), max_tokens=16)
    b = h.add("b", prompt(100, 8), max_tokens=16)
    while not h.sched.num_preemptions:
        h.step()
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out, _ = h.step()
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b" and 0 < new.num_computed_tokens < len(new.token_ids)
    assert new.num_computed_tokens % BS == 0
    assert a.status == RequestStatus.FINISHED_ABORTED
    h.run_until_done()
    assert b.num_output_tokens == 16


def test_running_request_preempts_itself_when_alone():
    # One request that outgrows the whole pool is preempted (not crashed on).
    h = Harness(num_blocks=3, max_num_batched_tokens=32, prefix_caching=False)   # 2 usable blocks
    r = h.add("r", prompt(1, 7), max_tokens=5)
    h.step()                                           # 7 prompt tokens in 2 blocks
    h.step()                                           # the 8th token fills them
    out, _ = h.step()                                  # the 9th needs a 3rd block
    assert r.status == RequestStatus.PREEMPTED and out.num_scheduled_tokens == {}
    assert out.finished_req_ids == {"r"} and list(h.sched.waiting) == [r]
    assert h.sched.kv.num_free_blocks == 2


# ---- priority scheduling ------------------------------------------------------------------
def test_priority_policy_admits_by_priority_then_arrival():
    h = Harness(max_num_seqs=1, policy="priority")
    order = [("late-low", 5), ("urgent", -1), ("normal-1", 0), ("normal-2", 0), ("low", 5)]
    for i, (name, priority) in enumerate(order):
        h.add(name, prompt(10 * i + 3, 4), priority=priority, max_tokens=2)
    assert [r.request_id for r in h.sched.waiting] == ["urgent", "normal-1", "normal-2", "late-low", "low"]
    admitted = []
    while h.sched.has_unfinished_requests():
        out, _ = h.step()
        admitted += [n.req_id for n in out.scheduled_new_reqs]
    assert admitted == ["urgent", "normal-1", "normal-2", "late-low", "low"]
    assert free_blocks_all_returned(h)


def test_fcfs_policy_keeps_arrival_order():
    h = Harness(max_num_seqs=1)
    for i, name in enumerate(["a", "b", "c"]):
        h.add(name, prompt(10 * i + 3, 4), max_tokens=2)
    admitted = []
    while h.sched.has_unfinished_requests():
        out, _ = h.step()
        admitted += [n.req_id for n in out.scheduled_new_reqs]
    assert admitted == ["a", "b", "c"]


def test_priority_policy_preempts_the_least_urgent_running_request():
    # As test_preemption_when_blocks_run_out, but the request admitted first is the less urgent one:
    # FCFS would preempt b (admitted last); priority preempts a. c waits (two running at most).
    h = Harness(num_blocks=7, max_num_batched_tokens=32, max_num_seqs=2, prefix_caching=False, policy="priority")
    a = h.add("a", prompt(1, 8), priority=1, max_tokens=16)
    out, _ = h.step()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"]
    b = h.add("b", prompt(100, 8), priority=0, max_tokens=16)
    c = h.add("c", prompt(200, 3), priority=2, max_tokens=1)
    out, _ = h.step()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"] and h.sched.running == [b, a]   # urgent first
    while not h.sched.num_preemptions:
        out, _ = h.step()
        assert b.status == RequestStatus.RUNNING
    assert a.status == RequestStatus.PREEMPTED and a.num_preemptions == 1 and b.num_preemptions == 0
    assert "a" in out.finished_req_ids and out.num_scheduled_tokens == {"b": 1}
    assert list(h.sched.waiting) == [a, c]   # back at its place: before the less urgent c
    h.run_until_done()
    assert a.num_output_tokens == 16 and b.num_output_tokens == 16 and c.num_output_tokens == 1
    assert free_blocks_all_returned(h)


def test_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy='lifo'"):
        SchedulerConfig(policy="lifo")
