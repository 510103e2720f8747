"""Scheduler driven directly with fake model outputs (tests/engine/scheduler_harness.py): token
budget, max_num_seqs, chunked prefill, prefix hits, aborts and token-id stop conditions. Preemption
and the priority policy: test_scheduler_preemption.py."""
from __future__ import annotations

import pytest

from shardserve.engine.request import RequestStatus
from tests.engine.scheduler_harness import EOS, Harness, free_blocks_all_returned, prompt


# ---- budgets ------------------------------------------------------------------------------
def test_token_budget_respected_every_step_and_everything_finishes():
    h = Harness(max_num_batched_tokens=16, max_num_seqs=8)
    reqs = [h.add(f"r{i}", prompt(10 + 100 * i, 5 + 7 * i), max_tokens=3 + i) for i in range(6)]
    h.run_until_done()
    assert all(out.total_num_scheduled_tokens <= 16 for out in h.history)
    assert max(out.total_num_scheduled_tokens for out in h.history) == 16   # the budget gets used
    for i, req in enumerate(reqs):
        assert req.status == RequestStatus.FINISHED_LENGTH
        assert req.num_output_tokens == 3 + i
    assert free_blocks_all_returned(h)


def test_max_num_seqs_respected():
    h = Harness(max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(5):
        h.add(f"r{i}", prompt(10 * i + 3, 3), max_tokens=4)
    out, _ = h.step()
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}      # FCFS, only 2 fit
    assert [r.request_id for r in h.sched.waiting] == ["r2", "r3", "r4"]
    h.run_until_done()
    assert all(len(o.num_scheduled_tokens) <= 2 for o in h.history)
    assert free_blocks_all_returned(h)


def test_chunked_prefill_shares_budget_with_decodes():
    h = Harness(max_num_batched_tokens=16)
    h.add("d1", prompt(1, 3), max_tokens=50)
    h.add("d2", prompt(20, 3), max_tokens=50)
    h.step()                                            # both prefilled, one token each
    long = h.add("long", prompt(100, 40), max_tokens=5)
    chunks = []
    while long.num_output_tokens == 0:
        out, updates = h.step()
        assert out.num_scheduled_tokens["d1"] == 1 and out.num_scheduled_tokens["d2"] == 1
        chunks.append(out.num_scheduled_tokens["long"])
        gained = {u.request.request_id: u.new_token_ids for u in updates}
        assert len(gained["d1"]) == 1 and len(gained["d2"]) == 1
        if long.num_computed_tokens < 40:
            assert "long" not in gained                 # no token from a partial prefill
    assert chunks == [14, 14, 12]
    assert long.num_computed_tokens == 40 and long.num_output_tokens == 1
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"d1": 1, "d2": 1, "long": 1}


def test_no_chunked_prefill_waits_for_a_whole_prompt():
    h = Harness(max_num_batched_tokens=16, max_model_len=16, chunked_prefill=False)
    h.add("d", prompt(1, 3), max_tokens=10)
    h.step()
    h.add("p", prompt(50, 16), max_tokens=2)
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"d": 1}         # 16 tokens do not fit next to a decode
    h.sched.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"p": 16}


# ---- prefix caching -----------------------------------------------------------------------
def test_prefix_hit_sets_num_computed_tokens():
    h = Harness(max_num_batched_tokens=64)
    shared = prompt(1, 16)
    h.add("a", shared + [90, 91], max_tokens=2)
    h.run_until_done()
    b = h.add("b", shared + [70, 71, 72], max_tokens=2)
    out = h.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 16 and b.num_computed_tokens == 16 + 3 and b.num_cached_tokens == 16
    assert out.num_scheduled_tokens == {"b": 3}
    assert h.sched.kv.prefix_cache_hits == 16
    assert h.sched.kv.prefix_cache_queries == 18 + 19


def test_identical_prompt_recomputes_its_last_token():
    h = Harness(max_num_batched_tokens=64)
    h.add("a", prompt(1, 16), max_tokens=1)
    h.run_until_done()
    b = h.add("b", prompt(1, 16), max_tokens=1)
    out = h.schedule()
    assert b.num_cached_tokens == 12 and out.num_scheduled_tokens == {"b": 4}


def test_prefix_hit_within_one_step_and_no_hit_without_caching():
    for caching, expected in ((True, 8), (False, 0)):
        h = Harness(max_num_batched_tokens=64, prefix_caching=caching)
        h.add("a", prompt(1, 10), max_tokens=1)
        b = h.add("b", prompt(1, 10), max_tokens=1)
        out = h.schedule()
        assert b.num_cached_tokens == expected
        assert out.num_scheduled_tokens == {"a": 10, "b": 10 - expected}


def test_prompt_logprobs_request_skips_prefix_cache():
    h = Harness(max_num_batched_tokens=64)
    h.add("a", prompt(1, 16), max_tokens=1)
    h.run_until_done()
    b = h.add("b", prompt(1, 16), max_tokens=1, prompt_logprobs=0)
    out = h.schedule()
    assert b.num_cached_tokens == 0 and out.num_scheduled_tokens == {"b": 16}


def test_chunked_prefill_with_prefix_hit():
    h = Harness(max_num_batched_tokens=8)
    h.add("a", prompt(1, 20), max_tokens=1)
    h.run_until_done()
    b = h.add("b", prompt(1, 16) + prompt(300, 14), max_tokens=1)   # 30 tokens, 16 cached
    chunks = []
    while b.num_output_tokens == 0:
        out, _ = h.step()
        chunks.append(out.num_scheduled_tokens["b"])
    assert b.num_cached_tokens == 16 and chunks == [8, 6]


# ---- finishing ----------------------------------------------------------------------------
def test_abort_frees_blocks_running_and_waiting():
    h = Harness(max_num_batched_tokens=16, max_num_seqs=1)
    a = h.add("a", prompt(1, 10), max_tokens=20)
    b = h.add("b", prompt(50, 10), max_tokens=20)
    out = h.schedule()
    assert h.sched.kv.num_free_blocks < h.sched.kv.pool.num_usable_blocks
    done = h.sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)
    assert done == [a, b]
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert free_blocks_all_returned(h) and not h.sched.has_unfinished_requests()
    # The step that was in flight when a was aborted brings nothing back.
    assert h.sched.update_from_output(out, h.model(out)) == []
    assert a.num_output_tokens == 0
    assert h.sched.schedule().finished_req_ids == {"a", "b"}    # workers drop their state
    assert h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []   # idempotent


def test_stop_on_max_tokens():
    h = Harness()
    r = h.add("r", prompt(1, 5), max_tokens=3)
    for i in range(3):
        out, (up,) = h.step()
        assert up.finished == (i == 2)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3
    assert r.stop_reason is None
    assert free_blocks_all_returned(h) and not h.sched.has_unfinished_requests()


def test_stop_on_max_model_len():
    h = Harness(max_model_len=8)
    r = h.add("r", prompt(1, 5), max_tokens=None)
    h.run_until_done()
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 8


def test_stop_on_eos_and_ignore_eos():
    h = Harness()
    r = h.add("r", prompt(1, 5))
    keep = h.add("keep", prompt(1, 5), ignore_eos=True)
    _, updates = h.step({"r": 7, "keep": 7})
    assert not any(u.finished for u in updates)
    _, updates = h.step({"r": EOS, "keep": EOS})
    done = {u.request.request_id: u.finished for u in updates}
    assert done == {"r": True, "keep": False}
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert r.output_token_ids == [7, EOS]
    assert keep.status == RequestStatus.RUNNING
    assert "r" not in h.sched.kv.requests


def test_stop_token_ids_sets_stop_reason():
    h = Harness()
    r = h.add("r", prompt(1, 5), stop_token_ids=[77, 78])
    h.step({"r": 5})
    h.step({"r": 78})
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 78


def test_min_tokens_delays_eos_and_stop_token_ids():
    h = Harness()
    r = h.add("r", prompt(1, 5), min_tokens=3, stop_token_ids=[77])
    for tok in (EOS, 77):
        h.step({"r": tok})
        assert r.status == RequestStatus.RUNNING
    # vLLM's stop check: stop tokens count once min_tokens tokens exist (the sampler keeps them
    # from being sampled before that).
    h.step({"r": 77})
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 77
    assert r.output_token_ids == [EOS, 77, 77]


def test_length_wins_when_no_stop_token():
    h = Harness()
    r = h.add("r", prompt(1, 5), max_tokens=2, stop_token_ids=[77])
    h.step({"r": 5})
    h.step({"r": 6})
    assert r.status == RequestStatus.FINISHED_LENGTH and r.stop_reason is None


def test_finished_ids_reach_workers_once():
    h = Harness()
    h.add("r", prompt(1, 5), max_tokens=1)
    h.step()
    assert "r" not in h.history[-1].finished_req_ids
    out = h.schedule()
    assert out.finished_req_ids == {"r"} and out.is_empty
    assert "r" not in h.worker
    assert h.schedule().finished_req_ids == set()


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_tiny_budgets_still_make_progress(budget):
    h = Harness(max_num_batched_tokens=budget, num_blocks=32)
    reqs = [h.add(f"r{i}", prompt(10 * i + 1, 6), max_tokens=4) for i in range(3)]
    h.run_until_done()
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 4 for r in reqs)
    assert free_blocks_all_returned(h)
