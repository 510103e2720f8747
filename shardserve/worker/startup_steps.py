"""Steps a worker runs at start-up, before any request: the profiling step that sizes the KV pool
on a GPU (worker/kv_sizing.py) and the warm-up of the kernel variants only mixed steps use."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardserve.distributed.parallel_state import get_pp_group
from shardserve.kernels.gemv import triton_gemv
from shardserve.layers.sampler import SamplingMetadata
from shardserve.sampling_params import SamplingParams
from shardserve.utils import cdiv
from shardserve.worker.input_batch import update_states
from shardserve.worker.step_io import CachedRequestData, NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from shardserve.worker.model_runner import ModelRunner


def profile_step(runner: ModelRunner, num_tokens: int, max_model_len: int, max_num_seqs: int) -> None:
    """The largest step the scheduler may issue (requests of up to max_model_len tokens summing to
    num_tokens), then the sampler's largest batch: what sizing the KV pool measures on a GPU."""
    sched = SchedulerOutput()
    remaining, block = num_tokens, 1
    while remaining > 0:
        n = min(remaining, max_model_len)
        num_blocks = cdiv(n, runner.block_size)
        req_id = f"_profile_{len(sched.scheduled_new_reqs)}"
        sched.scheduled_new_reqs.append(NewRequestData(
            req_id=req_id, token_ids=[0] * n, num_prompt_tokens=n, sampling_params=SamplingParams(max_tokens=1),
            block_ids=list(range(block, block + num_blocks)), num_computed_tokens=0))
        sched.num_scheduled_tokens[req_id] = n
        block += num_blocks
        remaining -= n
    sched.total_num_scheduled_tokens = num_tokens
    runner.execute_model(sched)
    # The sampler's largest batch, with every option that allocates: sort for top-k/top-p,
    # penalty tensors and logprobs.
    n, vocab = max_num_seqs, runner.model_config.vocab_size
    logits = torch.randn(n, vocab, device=runner.device)
    column = torch.ones(n, device=runner.device)
    md = SamplingMetadata(temperature=column, greedy=torch.zeros(n, dtype=torch.bool, device=runner.device),
                          all_greedy=False, top_p=column * 0.9, top_k=column.long() * 50, min_p=column * 0.01,
                          presence_penalty=column, frequency_penalty=column, repetition_penalty=column * 1.1,
                          output_token_counts=torch.zeros(n, vocab, device=runner.device),
                          prompt_token_mask=torch.zeros(n, vocab, dtype=torch.bool, device=runner.device),
                          num_logprobs=(runner.model_config.max_logprobs if runner.model_config.max_logprobs >= 0
                                        else vocab))
    runner.sampler(logits, md)
    del logits, md
    sched = SchedulerOutput(finished_req_ids=set(sched.num_scheduled_tokens))
    update_states(runner.states, sched)

def warm_up_mixed_step(runner: ModelRunner) -> None:
    """Two small greedy steps on the pool in service, the second a decode beside a prefill chunk,
    so that Triton compiles, at start-up, the kernel variants only such steps use (decode
    attention without the fused rotary, greedy sampling's argmax, and any kernel run eagerly: a
    pool past 2^31 elements makes its strides 64-bit, another variant than the profiling pool's).
    Compiled at the first such step in service, they stalled it for seconds (8B offline
    throughput on a fresh machine: MFU 30% instead of 35%). Blocks 1-3 are written (no request
    holds any block yet), then zeroed again."""
    block_size = runner.block_size
    if runner.config.scheduler_config.max_model_len < block_size + 2 or runner.kv_caches[0].shape[-3] < 4:
        return
    params = SamplingParams(temperature=0, max_tokens=2)   # greedy: the argmax kernels too
    prompt = NewRequestData(req_id="_warm_0", token_ids=[0] * (block_size + 1), num_prompt_tokens=block_size + 1,
                            sampling_params=params, block_ids=[1, 2], num_computed_tokens=0)
    first = SchedulerOutput(scheduled_new_reqs=[prompt], num_scheduled_tokens={"_warm_0": block_size + 1},
                            total_num_scheduled_tokens=block_size + 1)
    runner.execute_model(first)
    second = NewRequestData(req_id="_warm_1", token_ids=[0, 0], num_prompt_tokens=2, sampling_params=params,
                            block_ids=[3], num_computed_tokens=0)
    decode = CachedRequestData(req_id="_warm_0", new_token_ids=[0], new_block_ids=[],
                               num_computed_tokens=block_size + 1)
    mixed = SchedulerOutput(scheduled_new_reqs=[second], scheduled_cached_reqs=[decode],
                            num_scheduled_tokens={"_warm_0": 1, "_warm_1": 2}, total_num_scheduled_tokens=3)
    runner.execute_model(mixed)
    update_states(runner.states, SchedulerOutput(finished_req_ids={"_warm_0", "_warm_1"}))
    runner._zero_blocks([1, 2, 3])   # the pool as it was allocated
    # The LM head runs outside the graphs, on the rows sampled: Triton specialises a row count of 1
    # and one divisible by 16 apart from others, and the steps above sampled 1 and 2 rows. Where no
    # other layer shares the head's GEMV variant (FP8 or INT4 layers, a bf16 head), 16 sampled rows
    # compiled it mid-run: a 0.1-0.4 s stall of G2 on an H100.
    if get_pp_group().is_last:
        hidden = torch.zeros(triton_gemv.MAX_ROWS, runner.model_config.hf_config["hidden_size"],
                             dtype=runner.model_config.compute_dtype, device=runner.device)
        runner.model.compute_logits(hidden)
