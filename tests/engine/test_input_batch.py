"""A step's flat inputs (worker/input_batch.py): the columns hold the right values, each starts
16-byte aligned whatever the step's size (Triton compiles a kernel again for an unaligned pointer,
mid-run), and the start-up warm-up steps leave no request behind."""
from __future__ import annotations

import pytest
import torch

from shardserve import LLM, SamplingParams
from shardserve.worker.input_batch import prepare_inputs, update_states
from shardserve.worker.startup_steps import warm_up_mixed_step
from shardserve.worker.step_io import CachedRequestData, NewRequestData, SchedulerOutput
from tests.tiny_models import make_tiny_checkpoint


@pytest.mark.parametrize("decodes,prompt", [(1, 4), (2, 5), (3, 3), (0, 7)])
def test_columns_hold_the_step_and_start_aligned(decodes, prompt):
    bs, states = 4, {}
    sched = SchedulerOutput()
    for i in range(decodes):   # each has 5 tokens computed, its 6th is decoded now
        blocks = [2 * i + 1, 2 * i + 2]
        sched.scheduled_new_reqs.append(NewRequestData(f"d{i}", [10 + i] * 5, 5, SamplingParams(), blocks, 0))
    update_states(states, sched)
    step = SchedulerOutput(scheduled_new_reqs=[NewRequestData("p", list(range(100, 100 + prompt)), prompt,
                                                               SamplingParams(), [20, 21], 0)])
    for i in range(decodes):
        step.scheduled_cached_reqs.append(CachedRequestData(f"d{i}", [50 + i], [], 5))
        step.num_scheduled_tokens[f"d{i}"] = 1
    step.num_scheduled_tokens["p"] = prompt
    step.total_num_scheduled_tokens = decodes + prompt
    update_states(states, step)
    inputs = prepare_inputs(states, step, bs, torch.device("cpu"))
    total = decodes + prompt
    assert inputs.req_ids == [f"d{i}" for i in range(decodes)] + ["p"]
    assert inputs.input_ids.tolist() == [50 + i for i in range(decodes)] + list(range(100, 100 + prompt))
    assert inputs.positions.tolist() == [5] * decodes + list(range(prompt))
    slots = [(2 * i + 2) * bs + 1 for i in range(decodes)] + [(20 + p // bs) * bs + p % bs for p in range(prompt)]
    assert inputs.attn.slot_mapping.tolist() == slots
    assert inputs.seq_lens.tolist() == [6] * decodes + [prompt]
    assert inputs.sample_indices.tolist() == list(range(decodes)) + [total - 1]
    for column in (inputs.input_ids, inputs.positions, inputs.attn.slot_mapping, inputs.seq_lens,
                   inputs.sample_indices):
        assert column.storage_offset() * column.element_size() % 16 == 0
    # the three per-token columns as rows of one view (a graph takes them in one copy), and the graph's
    # buffers filled from it, the padding's slots the scratch slot
    assert inputs.token_columns.tolist() == [inputs.input_ids.tolist(), inputs.positions.tolist(), slots]
    assert inputs.samples_every_row == (decodes + 1 == total)
    from shardserve.worker.cuda_graphs import StaticTokens
    tokens = StaticTokens(16, 999, torch.device("cpu"))
    tokens.load(inputs.token_columns, total + 2)
    assert tokens.input_ids[:total].tolist() == inputs.input_ids.tolist()
    assert tokens.positions[:total].tolist() == inputs.positions.tolist()
    assert tokens.slots[:total + 2].tolist() == slots + [999, 999]


def test_decodes_come_longest_context_first():
    """The decode attention kernel starts its programs in batch order, so decodes are laid out by
    decreasing context (short ones fill the tail); prefill chunks keep the scheduler's order."""
    bs, states, contexts = 4, {}, {"a": 3, "b": 9, "c": 5, "d": 9}
    sched = SchedulerOutput()
    for r, ctx in contexts.items():
        sched.scheduled_new_reqs.append(NewRequestData(r, [7] * ctx, ctx, SamplingParams(), [1, 2, 3], 0))
    sched.scheduled_new_reqs.append(NewRequestData("p2", [1, 2], 0, SamplingParams(), [4], 0))
    sched.scheduled_new_reqs.append(NewRequestData("p1", [3, 4, 5], 0, SamplingParams(), [5], 0))
    update_states(states, sched)
    step = SchedulerOutput()
    for r, ctx in contexts.items():
        step.scheduled_cached_reqs.append(CachedRequestData(r, [8], [], ctx))
        step.num_scheduled_tokens[r] = 1
    step.num_scheduled_tokens.update({"p2": 2, "p1": 3})
    step.total_num_scheduled_tokens = len(contexts) + 5
    update_states(states, step)
    inputs = prepare_inputs(states, step, bs, torch.device("cpu"))
    assert inputs.req_ids == ["b", "d", "c", "a", "p2", "p1"]
    assert inputs.seq_lens.tolist() == [10, 10, 6, 4, 2, 3]
    assert inputs.positions.tolist()[:4] == [9, 9, 5, 3]


def test_warm_up_steps_leave_nothing_behind(tmp_path):
    """The CUDA start-up warm-up (run here by hand on a fresh CPU engine): no request state and no
    K/V stay behind, so the engine then gives a fresh engine's tokens."""
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    prompts = [[5, 17, 99, 3, 250], list(range(30, 70))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = []
    for warm in (True, False):
        llm = LLM(path, kv_cache_memory="16MiB", show_progress=False)
        try:
            runner = llm.engine.executor.worker.model_runner
            if warm:
                steps = []
                real_step = runner.execute_model
                runner.execute_model = lambda sched: steps.append(sched.total_num_scheduled_tokens) or real_step(sched)
                warm_up_mixed_step(runner)
                del runner.execute_model
                assert steps == [17, 3]   # it ran: a 17-token prefill, then a decode beside a 2-token one
                assert runner.states == {}
                assert all(not pool.narrow(pool.dim() - 3, 0, 4).any() for pool in runner.kv_pools)   # zero again
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.engine.shutdown()
    assert tokens[0] == tokens[1]
