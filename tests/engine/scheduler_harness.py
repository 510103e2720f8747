"""A Scheduler driven directly with fake model outputs, for the scheduler tests: a fake worker
mirrors what real workers do with each SchedulerOutput (`update_states`), so every step also checks
that the workers would hold exactly the scheduler's tokens and block ids."""
from __future__ import annotations

from shardserve.config import CacheConfig, SchedulerConfig
from shardserve.engine.request import Request
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
