"""The draft model of speculative decoding (`--speculative-config '{"model": PATH, ...}'`): a small
model with the target's vocabulary, loaded beside it on every worker (sharded over the same TP
group), with its own KV pool addressed by the target's block tables.

After each target step the draft catches up on every token the target computed (prompt chunks,
and for requests that sampled the accepted tokens too), then drafts k tokens greedily, one
single-token pass at a time. Its greedy pick is a one-hot draft distribution, which the rejection
sampler verifies exactly (spec_decode/rejection_sampler.py). The scheduler reserves k lookahead
slots per request for the positions the draft writes past the known tokens. A draft is only ever
a proposal: stale draft KV (e.g. after a prefix-cache hit on blocks a draft never saw) costs
acceptance, never correctness."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardserve.config import SpeculativeConfig
from shardserve.distributed.parallel_state import get_tp_group
from shardserve.kernels.cpu import cpu_ops
from shardserve.layers.attention import AttentionContext
from shardserve.layers.attention.cpu_native import CpuNativeAttentionBackend
from shardserve.layers.attention.cuda_backend import CudaAttentionBackend
from shardserve.models.loader import load_model
from shardserve.worker.input_batch import CachedRequestState, prepare_inputs
from shardserve.worker.step_graphs import StepGraphs
from shardserve.worker.step_io import SchedulerOutput

if TYPE_CHECKING:
    from shardserve.worker.model_runner import ModelRunner


class DraftProposer:
    def __init__(self, runner: ModelRunner, spec: SpeculativeConfig) -> None:
        # A weak reference: the runner holds us, and a cycle would keep both (and the GPU memory
        # they hold) alive until the garbage collector runs.
        self._runner, self.k = weakref.ref(runner), spec.num_speculative_tokens
        mc = runner.model_config
        self.model = load_model(spec.model, spec.draft_hf_config, mc.dtype, runner.device,
                                show_progress=runner.show_progress, compute_dtype=mc.compute_dtype,
                                load_format=mc.load_format)
        self._check_attention()
        if runner.device.type == "cpu" and mc.compute_dtype == torch.float32 and cpu_ops.available():
            cpu_ops.pack_weights(self.model, torch.bfloat16 if mc.dtype == torch.bfloat16 else torch.float32)
        self.computed: dict[str, int] = {}   # per request: leading positions whose draft KV is valid
        self.kv_pool: torch.Tensor | None = None
        self.graphs: StepGraphs | None = None   # CUDA graphs of the draft's steps (set with the pool)

    @property
    def runner(self) -> ModelRunner:
        return self._runner()

    def _check_attention(self) -> None:
        """The draft's attention runs on the target's backend and pool dtype."""
        runner, spec = self.runner, self.model.attention_layers()[0].spec
        backend = runner.backend
        cpu_refuses = (isinstance(backend, CpuNativeAttentionBackend)
                       and not CpuNativeAttentionBackend.supports(spec, runner.kv_cache_dtype))
        cuda_refuses = (isinstance(backend, CudaAttentionBackend)
                        and not CudaAttentionBackend.supports(spec, runner.block_size))
        if cpu_refuses or cuda_refuses:
            raise ValueError(f"the draft model's attention (head_dim {spec.head_dim}, {spec.num_kv_heads} KV heads) "
                             f"does not run on the target's {type(backend).__name__}")

    # ---- KV ----------------------------------------------------------------------------------
    def allocate(self, pool_blocks: int) -> torch.Tensor:
        runner = self.runner
        layers = self.model.attention_layers()
        spec = layers[0].spec
        shape = runner.backend.kv_cache_shape(pool_blocks, runner.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_pool = torch.zeros((len(layers), *shape), dtype=runner.kv_cache_dtype, device=runner.device)
        for layer, cache in zip(layers, self.kv_pool.unbind(0)):
            layer.kv_cache = cache
        return self.kv_pool

    def release(self) -> None:
        self.kv_pool, self.graphs = None, None
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.empty(0)

    # ---- per step ----------------------------------------------------------------------------
    def track(self, sched: SchedulerOutput) -> None:
        """Before a step: forget finished requests; a new (or resumed) one starts where its prefix
        hits end."""
        for req_id in sched.finished_req_ids:
            self.computed.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self.computed[new.req_id] = new.num_computed_tokens

    def after_step(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """On every TP rank after the target's step: the driver's sampled tokens are shared (the
        other ranks have none), then all draft alike. `sampled`: the driver's tokens per request."""
        tp = get_tp_group()
        if tp.world_size > 1:
            req_ids = sorted(sched.num_scheduled_tokens)
            table = torch.zeros(len(req_ids), self.k + 2, dtype=torch.long)   # a count, then up to k + 1 tokens
            for row, req_id in enumerate(req_ids):
                tokens = sampled.get(req_id, [])
                table[row, 0] = len(tokens)
                table[row, 1:1 + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            table = table.to(self.runner.device)
            dist.broadcast(table, src=tp.ranks[0], group=tp.group)
            sampled = {req_id: row[1:1 + row[0]] for req_id, row in zip(req_ids, table.tolist()) if row[0]}
        return self.propose(sched, sampled)

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """After the target's step (on every TP rank, with the same `sampled`): catch up, then draft.
        Returns k drafts per request that sampled and may speculate."""
        runner = self.runner
        max_len = runner.config.scheduler_config.max_model_len
        states: dict[str, CachedRequestState] = {}
        for req_id, n in sched.num_scheduled_tokens.items():
            state = runner.states[req_id]
            new = sampled.get(req_id)
            # What the target computed this step, and the tokens it accepted (the last one is new).
            tokens = state.token_ids + new if new else state.token_ids[:state.num_computed_tokens + n]
            # Within the request's blocks (the scheduler's lookahead slots; a profiling step has none).
            tokens = tokens[:len(state.block_ids) * runner.block_size]
            start = min(self.computed.get(req_id, 0), len(tokens) - 1)
            states[req_id] = CachedRequestState(req_id, tokens, state.num_prompt_tokens, state.sampling_params,
                                                state.block_ids, start)
            self.computed[req_id] = len(tokens)
        drafts: dict[str, list[int]] = {req_id: [] for req_id in sampled}
        picks = self._forward(states, {r: len(s.token_ids) - s.num_computed_tokens for r, s in states.items()})
        live = [r for r in sampled if r in picks and states[r].sampling_params.takes_drafts]
        for step in range(self.k):
            for req_id in live:
                drafts[req_id].append(picks[req_id])
            if step == self.k - 1:
                break
            live = [r for r in live if len(states[r].token_ids) + 1 < min(max_len, self._slots(states[r]))]
            if not live:
                break
            decode = {}
            for req_id in live:
                state = states[req_id]
                state.num_computed_tokens = len(state.token_ids)
                state.token_ids = state.token_ids + [picks[req_id]]
                decode[req_id] = 1
            picks = self._forward({r: states[r] for r in live}, decode)
        return {r: d for r, d in drafts.items() if d}

    def _slots(self, state: CachedRequestState) -> int:
        return len(state.block_ids) * self.runner.block_size

    def _forward(self, states: dict[str, CachedRequestState], scheduled: dict[str, int]) -> dict[str, int]:
        """One draft pass over `scheduled` tokens per request; greedy picks of those whose pass
        reaches their last token. Every TP rank gets the same logits (gathered), so the same picks."""
        runner = self.runner
        sched = SchedulerOutput(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()))
        inputs = prepare_inputs(states, sched, runner.block_size, runner.device)
        hidden = self.graphs.try_run(inputs) if self.graphs is not None else None
        if hidden is None:
            ctx = AttentionContext(runner.backend, runner.backend.build(inputs.attn, runner.device))
            hidden = self.model(inputs.input_ids, inputs.positions, ctx, None)
        if not inputs.sample_req_ids:
            return {}
        picks = self.model.compute_logits(hidden[inputs.sample_indices]).argmax(dim=-1).tolist()
        return dict(zip(inputs.sample_req_ids, picks))

