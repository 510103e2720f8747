"""Per-request state kept by a worker between steps, and the flattening of one step's requests into
model inputs (token ids, positions, slot mapping, block tables).

With async scheduling a step can be scheduled before the previous one's sampled tokens are known:
a decode's last input is then a placeholder the model runner fills from the device."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shardserve.layers.attention import CommonAttentionMetadata
from shardserve.sampling_params import SamplingParams
from shardserve.transfer import to_device
from shardserve.worker.step_io import SchedulerOutput


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    _table: np.ndarray | None = field(default=None, repr=False)

    def block_table(self) -> np.ndarray:
        """block_ids as an int32 array, rebuilt only when a block was added (every block_size
        tokens), so a step copies each row array to array instead of converting a list."""
        if self._table is None or len(self._table) != len(self.block_ids):
            self._table = np.asarray(self.block_ids, dtype=np.int32)
        return self._table


def update_states(states: dict[str, CachedRequestState], sched: SchedulerOutput) -> None:
    for req_id in sched.finished_req_ids:
        states.pop(req_id, None)
    for new in sched.scheduled_new_reqs:
        states[new.req_id] = CachedRequestState(new.req_id, list(new.token_ids), new.num_prompt_tokens,
                                                new.sampling_params, list(new.block_ids),
                                                new.num_computed_tokens)
    for cached in sched.scheduled_cached_reqs:
        state = states[cached.req_id]
        state.token_ids.extend(cached.new_token_ids)
        state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens


@dataclass
class StepInputs:
    req_ids: list[str]               # decodes first, then prefill chunks
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: CommonAttentionMetadata
    token_offsets: list[int]         # per request: index of its first token in the flat batch
    sample_req_ids: list[str]        # requests whose chunk ends at their last token
    sample_indices: torch.Tensor     # flat index of each one's last token
    outputs_before_sample: list[int]  # per sampled request: output tokens before the one drawn now
    placeholders: list[tuple[int, str]]   # (flat index, request): input is the previous step's sample
    seq_lens: torch.Tensor           # per request: tokens in its KV cache once this step ran
    # input_ids, positions and the slot mapping as the rows of one [3, tokens] view (graphs take them
    # in one copy)
    token_columns: torch.Tensor
    samples_every_row: bool          # every token is sampled, in order (sample_indices is 0..T-1)
    # Speculative decoding: per sampled request, the drafts its rows verify ([] for plain rows). A
    # request with d drafts has d + 1 consecutive rows in sample_indices.
    spec_drafts: list[list[int]] | None = None


def prepare_inputs(states: dict[str, CachedRequestState], sched: SchedulerOutput, block_size: int,
                   device: torch.device) -> StepInputs:
    scheduled = sched.num_scheduled_tokens
    # Decodes first, the longest contexts first: the decode attention kernel starts its programs in
    # this order, so in a large batch of mixed lengths the short ones fill the tail (a long one
    # started last would run alone). Prefill chunks keep the scheduler's order (a stable sort).
    req_ids = sorted(scheduled, key=lambda r: -states[r].num_computed_tokens if scheduled[r] == 1 else 1)
    num_decodes = sum(1 for r in req_ids if scheduled[r] == 1)
    total, num_reqs = sched.total_num_scheduled_tokens, len(req_ids)
    # The per-token and per-request columns share one host buffer and travel in one copy:
    # input ids, positions, slots (T each), then sequence lengths (R), then sample indices. Each
    # column starts 16-byte aligned (an even offset): Triton compiles a kernel again for a pointer
    # that is not, which would stall the first step of each odd size mid-run.
    t_col, r_col = total + total % 2, num_reqs + num_reqs % 2
    s_col = t_col if sched.scheduled_spec_decode_tokens else r_col   # drafts sample at every position
    flat = np.empty(3 * t_col + r_col + s_col, dtype=np.int64)
    input_ids, positions, slot_mapping = flat[:total], flat[t_col:t_col + total], flat[2 * t_col:2 * t_col + total]
    seq_lens = flat[3 * t_col:3 * t_col + num_reqs]
    max_blocks = max(len(states[r].block_ids) for r in req_ids)
    block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    query_lens, context_lens, offsets, sample_req_ids, sample_idx, outputs_before = [], [], [], [], [], []
    placeholders = []
    spec = sched.scheduled_spec_decode_tokens
    spec_drafts: list[list[int]] | None = [] if spec else None
    # Decodes in Python scalars, their ids and positions written as whole columns afterwards: per-request
    # numpy calls would cost more than the values. Prefill chunks and drafts take the general path.
    decode_ids: list[int] = []
    start = 0
    for i, req_id in enumerate(req_ids):
        state = states[req_id]
        n, ctx = scheduled[req_id], state.num_computed_tokens
        known = len(state.token_ids)
        table = state.block_table()
        block_tables[i, :len(table)] = table
        drafts = spec.get(req_id) if spec else None
        seq_lens[i] = ctx + n
        query_lens.append(n)
        context_lens.append(ctx)
        offsets.append(start)
        if i < num_decodes:   # n == 1 (a request with drafts schedules more): decodes come first, start == i
            if ctx < known:
                decode_ids.append(state.token_ids[ctx])
            else:   # its last token is still being sampled (one step ahead at most)
                assert ctx == known, f"{req_id}: {ctx + 1 - known} tokens not known yet"
                decode_ids.append(0)
                placeholders.append((start, req_id))
            slot_mapping[start] = state.block_ids[ctx // block_size] * block_size + ctx % block_size
        else:
            blocks = table.astype(np.int64)
            pos = np.arange(ctx, ctx + n)
            input_ids[start:start + min(n, known - ctx)] = state.token_ids[ctx:ctx + n]
            if drafts:   # the last known token, then the drafts; every position samples
                input_ids[start + known - ctx:start + n] = drafts
                sample_req_ids.append(req_id)
                sample_idx += range(start, start + n)
                outputs_before += range(known - state.num_prompt_tokens, ctx + n + 1 - state.num_prompt_tokens)
                spec_drafts.append(drafts)
            elif ctx + n > known:   # only the last token can still be in flight (one step ahead at most)
                assert ctx + n == known + 1, f"{req_id}: {ctx + n - known} tokens not known yet"
                input_ids[start + n - 1] = 0
                placeholders.append((start + n - 1, req_id))
            positions[start:start + n] = pos
            slot_mapping[start:start + n] = blocks[pos // block_size] * block_size + pos % block_size
        if ctx + n >= known and not drafts:   # the chunk reaches the end: it samples its last position
            sample_req_ids.append(req_id)
            sample_idx.append(start + n - 1)
            outputs_before.append(ctx + n - state.num_prompt_tokens)
            if spec_drafts is not None:
                spec_drafts.append([])
        start += n
    if decode_ids:   # the fast path's rows: the first len(decode_ids) tokens, contiguous
        input_ids[:len(decode_ids)] = decode_ids
        positions[:len(decode_ids)] = context_lens[:len(decode_ids)]
    samples = 3 * t_col + r_col
    end = samples + len(sample_idx)
    flat[samples:end] = sample_idx
    on_device = to_device(flat[:end], torch.int64, device)
    attn = CommonAttentionMetadata(
        num_decodes=num_decodes, query_lens=query_lens, context_lens=context_lens,
        block_tables=to_device(block_tables, torch.int32, device),
        slot_mapping=on_device[2 * t_col:2 * t_col + total], block_size=block_size)
    columns = on_device[:3 * t_col].view(3, t_col)[:, :total]
    return StepInputs(req_ids, columns[0], columns[1], attn, offsets, sample_req_ids,
                      on_device[samples:end], outputs_before, placeholders,
                      on_device[3 * t_col:3 * t_col + num_reqs], token_columns=columns, spec_drafts=spec_drafts,
                      samples_every_row=len(sample_idx) == total)   # (sample_idx increases)
