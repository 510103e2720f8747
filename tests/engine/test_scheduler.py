"""Scheduler driven directly with fake model outputs: token budget, max_num_seqs, chunked prefill,
prefix hits, preemption, aborts and token-id stop conditions.

A fake worker mirrors what real workers do with each SchedulerOutput (`update_states`), so every
step also checks that the workers would hold exactly the scheduler's tokens and block ids."""
from __future__ import annotations

import pytest

from shardserve.config import CacheConfig, SchedulerConfig
from shardserve.engine.request import Request, RequestStatus
from shardserve.engine.scheduler import RequestUpdate, Scheduler
from shardserve.sampling_params import SamplingParams
from shardserve.worker.input_batch import CachedRequestState, update_states
from shardserve.worker.step_io import ModelRunnerOutput, SchedulerOutput

BS = 4
EOS = 2


class Harness:
    def __init__(self, num_blocks: int = 64, max_num_batched_tokens: int = 16, max_num_seqs: int = 8,
                 max_model_len: int = 256, prefix_caching: bool = True, chunked_prefill: bool = True,
                 policy: str = "fcfs") -> None:
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_chunked_prefill=chunked_prefill, policy=policy)
        cache_config = CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(scheduler_config, cache_config, num_blocks)
        self.worker: dict[str, CachedRequestState] = {}
        self.next_token = 1000   # fake model: distinct tokens unless told otherwise
        self.history: list[SchedulerOutput] = []

    def add(self, req_id: str, prompt: list[int], priority: int = 0, **params) -> Request:
        params.setdefault("max_tokens", 100)
        req = Request(req_id, list(prompt), SamplingParams(**params), frozenset({EOS}), priority=priority)
        self.sched.add_request(req)
        return req

    def schedule(self) -> SchedulerOutput:
        s = self.sched
        out = s.schedule()
        self.history.append(out)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        update_states(self.worker, out)
        for req_id, n in out.num_scheduled_tokens.items():
            req, st = s.requests[req_id], self.worker[req_id]
            assert n >= 1
            assert st.token_ids == req.all_token_ids
            assert st.block_ids == s.kv.block_ids(req_id)
            assert st.num_computed_tokens + n == req.num_computed_tokens   # counted when scheduled
            assert len(st.block_ids) * BS >= st.num_computed_tokens + n   # room for every new token
        return out

    def model(self, out: SchedulerOutput, tokens: dict[str, int] | None = None) -> ModelRunnerOutput:
        """Sample for requests whose chunk reaches their last token, as the model runner does."""
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.worker[req_id]
            if st.num_computed_tokens + n == len(st.token_ids):
                if tokens and req_id in tokens:
                    sampled[req_id] = [tokens[req_id]]
                else:
                    sampled[req_id] = [self.next_token]
                    self.next_token += 1
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def step(self, tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[RequestUpdate]]:
        out = self.schedule()
        return out, self.sched.update_from_output(out, self.model(out, tokens))

    def run_until_done(self, max_steps: int = 500) -> int:
        steps = 0
        while self.sched.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def free_blocks_all_returned(h: Harness) -> bool:
    kv = h.sched.kv
    return kv.num_free_blocks == kv.pool.num_usable_blocks and not kv.requests


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
