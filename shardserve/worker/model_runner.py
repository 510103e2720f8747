"""Runs the model on one device: load, size and allocate the KV pool, prepare inputs, run, sample."""
from __future__ import annotations

import itertools
import logging
import time
from typing import Callable

import torch
import torch.distributed as dist

from shardserve.config import EngineConfig
from shardserve.distributed.comm import pp_recv_prev, pp_send_next
from shardserve.distributed.parallel_state import get_dp_group, get_pp_group, get_tp_group
from shardserve.kernels.cpu import cpu_ops
from shardserve.layers.attention import AttentionContext, TorchAttentionBackend
from shardserve.layers.attention.cpu_native import CpuNativeAttentionBackend
from shardserve.layers.attention.cuda_backend import CudaAttentionBackend
from shardserve.layers.moe import expert_load_report
from shardserve.layers.sampler import Sampler, compute_logprobs
from shardserve.models.loader import load_model
from shardserve.spec_decode.rejection_sampler import accept_drafts
from shardserve.structured.bitmask import GrammarBitmask
from shardserve.transfer import copy_stream, to_device
from shardserve.worker import kv_sizing
from shardserve.worker.draft_proposer import DraftProposer
from shardserve.worker.input_batch import CachedRequestState, StepInputs, prepare_inputs, update_states
from shardserve.worker.sampling_inputs import build_sampling_metadata
from shardserve.worker.startup_steps import warm_up_mixed_step
from shardserve.worker.step_graphs import StepGraphs
from shardserve.worker.step_io import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def _rows_to_lists(ids: torch.Tensor, lps: torch.Tensor, ranks: torch.Tensor, k: int):
    """First column is the chosen token; keep it plus the request's own top-k."""
    width = ids.shape[-1] if k == -1 else 1 + k
    return ids[:width].tolist(), lps[:width].tolist(), ranks[:width].tolist()


def _consecutive(values: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(values, values[1:]))


class PendingOutput:
    """A step's output that may still be on its way from the device: get() waits (once) for it."""

    def __init__(self, output: ModelRunnerOutput, finish: Callable[[], None] | None = None) -> None:
        self._output, self._finish = output, finish

    def get(self) -> ModelRunnerOutput:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return self._output


class ModelRunner:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset(),
                 show_progress: bool = True) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = config.device
        self.block_size = config.cache_config.block_size
        self.eos_token_ids = eos_token_ids
        self.show_progress = show_progress
        self.backend = TorchAttentionBackend()
        self.sampler = Sampler()
        self.grammars = GrammarBitmask(self.model_config.vocab_size, self.device)   # structured outputs
        self.states: dict[str, CachedRequestState] = {}
        self.model: torch.nn.Module | None = None
        self.drafter: DraftProposer | None = None   # speculative decoding with a draft model
        self.kv_caches: list[torch.Tensor] = []   # one per attention layer (views of kv_pools)
        self.kv_pools: list[torch.Tensor] = []    # what was allocated: all layers' caches in one where it can
        self.cuda_baseline = 0                   # bytes the GPU held before the model loaded (load_model)
        self.graphs: StepGraphs | None = None   # CUDA graphs of every kind, where steps replay them
        # The cache holds what attention multiplies: the compute dtype (fp32 where a CPU lacks
        # bf16 units; converting every gathered block each step would cost more than it saves);
        # or E4M3 with --kv-cache-dtype fp8, widened with the layer's scales as it is read.
        self.kv_cache_dtype = kv_sizing.FP8_KV if config.cache_config.fp8_kv else self.model_config.compute_dtype
        # The last step's sampled tokens, on the device, by request: async scheduling runs the next
        # step before they reach the scheduler, so its inputs take them from here.
        self.prev_sampled: torch.Tensor | None = None
        self.prev_rows: dict[str, int] = {}
        # Only TP rank 0 samples; under async scheduling it broadcasts the tokens to the others.
        self.broadcast_samples = config.scheduler_config.async_scheduling and get_tp_group().world_size > 1

    # ---- set-up ----------------------------------------------------------------------------
    def load_model(self) -> None:
        if self.device.type == "cuda":   # what the device holds before us: other processes, our context
            free, total = torch.cuda.mem_get_info(self.device)
            self.cuda_baseline = total - free - torch.cuda.memory_reserved(self.device)
        model_config = self.model_config
        start = time.perf_counter()
        self.model = load_model(model_config.model, model_config.hf_config, model_config.dtype, self.device,
                                show_progress=self.show_progress, compute_dtype=model_config.compute_dtype,
                                load_format=model_config.load_format, quantization=model_config.quantization,
                                cpu_offload_bytes=int(model_config.cpu_offload_gb * (1 << 30)))
        if self.device.type == "cpu":
            self._use_native_cpu_kernels()
        elif self.device.type == "cuda" and CudaAttentionBackend.supports(self.model.attention_layers()[0].spec,
                                                                          self.block_size):
            self.backend = CudaAttentionBackend()
        kv_sizing.check_fp8_kv_cache(self)
        spec = self.config.speculative_config
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftProposer(self, spec)   # checks it runs on our backend, packs it for the CPU
        if self.show_progress:   # vLLM's line, with the weights as this rank holds them
            held = {p.data_ptr(): p.numel() * p.element_size() for p in self.model.parameters()}
            logger.info("Model loading took %.4f GiB memory and %.6f seconds", sum(held.values()) / (1 << 30),
                        time.perf_counter() - start)

    def _use_native_cpu_kernels(self) -> None:
        """Hand the model to the native CPU kernels where they are built (the path itself is chosen in
        layers/cpu_path.py). With fp32 math, every matrix that multiplies is packed for the native
        GEMM in the checkpoint's values (bf16 stays bf16: half the bytes each decode step reads);
        with native half precision only the LM head is, for fp32 logits. Attention reads a bf16 or
        fp32 pool in place either way."""
        if not cpu_ops.available():
            return
        dtype, compute = self.model_config.dtype, self.model_config.compute_dtype
        if compute == torch.float32:
            n = cpu_ops.pack_weights(self.model, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
            logger.debug("CPU: %d weight matrices packed for the native kernel", n)
        elif compute == torch.bfloat16 and getattr(self.model, "lm_head", None) is not None:
            head = self.model.lm_head   # a quantized head: its linear, dequantized after loading (layers/vocab.py)
            head = head.linear if head.linear is not None else head
            weight = getattr(head, "weight", None)
            if weight is not None and weight.is_floating_point():   # not GGUF blocks
                head.weight = cpu_ops.pack_weight(weight.detach(), torch.bfloat16)
        kv_dtype = self.kv_cache_dtype   # bf16 weights: a bf16 pool (unless fp8), widened in registers
        if dtype == torch.bfloat16 and kv_dtype != kv_sizing.FP8_KV:
            kv_dtype = torch.bfloat16
        if CpuNativeAttentionBackend.supports(self.model.attention_layers()[0].spec, kv_dtype):
            self.backend, self.kv_cache_dtype = CpuNativeAttentionBackend(), kv_dtype

    def kv_bytes_per_block(self) -> int:
        """The target's KV per block, plus the draft model's (it shares the block tables)."""
        models = [self.model] + ([self.drafter.model] if self.drafter is not None else [])
        return sum(kv_sizing.kv_bytes_per_block(m, self.block_size, self.kv_cache_dtype) for m in models)

    def determine_num_blocks(self) -> int:
        return kv_sizing.determine_num_blocks(self)

    def wants_graphs(self) -> bool:
        parallel = self.config.parallel_config
        return (self.device.type == "cuda" and not self.model_config.enforce_eager
                and isinstance(self.backend, CudaAttentionBackend)
                and parallel.pipeline_parallel_size == 1)   # TP all-reduces (NCCL) are captured inside

    def release_kv_cache(self) -> None:
        self.kv_caches, self.kv_pools = [], []
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.empty(0)
        if self.drafter is not None:
            self.drafter.release()

    def initialize_kv_cache(self, num_blocks: int, capture_graphs: bool = True) -> None:
        self.release_kv_cache()   # a previous pool goes before the new one is allocated
        self.graphs = None
        graphs = capture_graphs and self.wants_graphs()
        pool_blocks = num_blocks + 1 if graphs else num_blocks   # + a scratch block for graph padding rows
        layers = self.model.attention_layers()
        shapes = [self.backend.kv_cache_shape(pool_blocks, self.block_size, layer.spec.num_kv_heads,
                                              layer.spec.head_dim) for layer in layers]
        # Zeroed: padding reads the null block; other blocks are zeroed again when handed out. One
        # tensor for all layers where their shapes agree, so that is one launch per step, not one per layer.
        if len(set(shapes)) == 1:
            self.kv_pools = [torch.zeros((len(layers), *shapes[0]), dtype=self.kv_cache_dtype, device=self.device)]
            self.kv_caches = list(self.kv_pools[0].unbind(0))
        else:
            self.kv_pools = [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device) for shape in shapes]
            self.kv_caches = list(self.kv_pools)
        for layer, cache in zip(layers, self.kv_caches):
            layer.kv_cache = cache
        if self.drafter is not None:   # zeroed with the target's blocks (_zero_blocks)
            self.kv_pools.append(self.drafter.allocate(pool_blocks))
        if graphs:
            self.graphs = StepGraphs(self.model, self.backend, self.device, self.model_config,
                                     self.config.scheduler_config, self.block_size, num_blocks)
            if self.drafter is not None:   # its k decode passes a step are where graphs pay most
                self.drafter.graphs = StepGraphs(self.drafter.model, self.backend, self.device, self.model_config,
                                                 self.config.scheduler_config, self.block_size, num_blocks)
        if capture_graphs and isinstance(self.backend, CudaAttentionBackend):   # the pool in service
            warm_up_mixed_step(self)

    # ---- one step --------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(sched).get()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingOutput:
        """Queue one step on the device and return without waiting for it (on a GPU; a CPU step
        runs here): the caller can prepare the next step while this one computes."""
        update_states(self.states, sched)
        if self.drafter is not None:
            self.drafter.track(sched)
        if self.grammars.matchers:   # finished, or new again after preemption (replayed from its tokens)
            self.grammars.drop([*sched.finished_req_ids, *(r.req_id for r in sched.scheduled_new_reqs)])
        out = ModelRunnerOutput()
        if sched.is_empty:
            if get_dp_group().world_size > 1:   # other replicas' tokens still need this rank's experts
                self.model.idle_step(self.model_config.compute_dtype, self.device)
            return PendingOutput(out)
        self._zero_fresh_blocks(sched)
        inputs = prepare_inputs(self.states, sched, self.block_size, self.device)
        in_flight = self._fill_placeholders(inputs) if inputs.placeholders else None
        pp = get_pp_group()
        intermediate = None
        if not pp.is_first:   # activations from the previous stage: [tokens, hidden] twice
            shape = (sched.total_num_scheduled_tokens, self.model_config.hf_config["hidden_size"])
            intermediate = tuple(pp_recv_prev([shape, shape], self.model_config.compute_dtype, self.device))
        hidden = self.graphs.try_run(inputs) if self.graphs is not None else None
        if hidden is None:
            ctx = AttentionContext(self.backend, self.backend.build(inputs.attn, self.device))
            hidden = self.model(inputs.input_ids, inputs.positions, ctx, intermediate)
        load = expert_load_report(self.model) if get_tp_group().rank == 0 else None   # TP peers route alike
        if load is not None:
            logger.info("stage %d %s", pp.rank, load)
        if not pp.is_last:
            pp_send_next(list(hidden))
            return PendingOutput(out)
        self._prompt_logprobs(inputs, hidden, out)
        pending = self._sample(inputs, hidden, out, in_flight)
        if self.drafter is not None:   # the draft model's turn: it needs this step's tokens now
            out = pending.get()
            drafts = self.drafter.after_step(sched, out.sampled_token_ids)
            if get_tp_group().rank == 0:
                out.draft_token_ids = drafts
            pending = PendingOutput(out)
        return pending

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput,
                in_flight: torch.Tensor | None) -> PendingOutput:
        if not inputs.sample_req_ids:
            return PendingOutput(out)
        states = [self.states[r] for r in inputs.sample_req_ids]
        rows = hidden if inputs.samples_every_row else hidden[inputs.sample_indices]   # (a decode step: no gather)
        logits = self.model.compute_logits(rows)   # a TP collective
        tp = get_tp_group()
        if tp.rank != 0:   # only the driver samples; the scheduler (or the driver's broadcast) brings the tokens
            if self.broadcast_samples:
                self._remember_samples(inputs.sample_req_ids, torch.empty(len(states), dtype=torch.long,
                                                                          device=self.device))
            return PendingOutput(out)
        if inputs.spec_drafts is not None:
            return PendingOutput(self._verify_drafts(out, inputs, states, logits, in_flight))
        md = build_sampling_metadata(states, inputs.outputs_before_sample, self.model_config.vocab_size,
                                     self.eos_token_ids, self.device, self._pending_tokens(inputs, states, in_flight))
        logits, grammar_rows = self.grammars.mask_logits(logits, states)
        sampled, lp_rows = self.sampler(logits, md)
        self.grammars.record(inputs.sample_req_ids, sampled, grammar_rows)
        self._remember_samples(inputs.sample_req_ids, sampled)
        return self._pending_output(out, inputs.sample_req_ids, states, sampled, lp_rows)

    def _verify_drafts(self, out: ModelRunnerOutput, inputs: StepInputs, states: list[CachedRequestState],
                       logits: torch.Tensor, in_flight: torch.Tensor | None) -> ModelRunnerOutput:
        """A step that carried drafts: each request's rows (one per draft, plus one) go through the
        grammar mask and the sampler, then the drafts are accepted while they equal the rows' draws
        (spec_decode/rejection_sampler.py); requests without drafts draw their one token there
        too (with async scheduling their input may be the previous step's sample, in flight; and
        a next step may already wait for the token they draw now, `_remember_samples`). Logprobs
        are only asked by requests without drafts (the scheduler proposes none for them): each has
        one row."""
        drafts = inputs.spec_drafts
        row_states = [state for state, request_drafts in zip(states, drafts) for _ in range(len(request_drafts) + 1)]
        first_rows = dict(zip(inputs.sample_req_ids, itertools.accumulate((len(d) + 1 for d in drafts), initial=0)))
        md = build_sampling_metadata(row_states, inputs.outputs_before_sample, self.model_config.vocab_size,
                                     self.eos_token_ids, self.device,
                                     self._pending_tokens(inputs, states, in_flight, first_rows))
        logits, _ = self.grammars.mask_logits(logits, row_states, drafts)
        sampled, lp_rows = self.sampler(logits, md)   # every row drawn as a step without drafts would
        tokens = accept_drafts(sampled.tolist(), [len(d) for d in drafts], [t for d in drafts for t in d])
        self.grammars.record_lists(inputs.sample_req_ids, tokens)
        self._remember_samples(inputs.sample_req_ids, torch.tensor([t[-1] for t in tokens], device=self.device))
        for req_id, state, request_tokens in zip(inputs.sample_req_ids, states, tokens):
            out.sampled_token_ids[req_id] = request_tokens
            k, row = state.sampling_params.logprobs, first_rows[req_id]
            if k is not None and lp_rows is not None:   # a request without drafts: one row
                out.logprobs[req_id] = _rows_to_lists(lp_rows[0][row], lp_rows[1][row], lp_rows[2][row], k)
        return out

    def _remember_samples(self, req_ids: list[str], sampled: torch.Tensor) -> None:
        tp = get_tp_group()
        if self.broadcast_samples:
            dist.broadcast(sampled, src=tp.ranks[0], group=tp.group)   # every rank embeds the next inputs
        self.prev_sampled, self.prev_rows = sampled, {r: i for i, r in enumerate(req_ids)}

    def _fill_placeholders(self, inputs: StepInputs) -> torch.Tensor:
        """Inputs that are the tokens the previous step sampled, taken from its device tensor.
        Returns those tokens, in placeholder order."""
        try:
            rows = [self.prev_rows[r] for _, r in inputs.placeholders]
        except KeyError as e:
            raise RuntimeError(f"request {e.args[0]} needs a token from the previous step, which did not "
                               "sample for it") from None
        flat = [i for i, _ in inputs.placeholders]
        if _consecutive(flat) and _consecutive(rows):   # a decode batch in the previous step's order: one copy
            tokens = self.prev_sampled[rows[0]:rows[0] + len(rows)]
            inputs.input_ids[flat[0]:flat[0] + len(flat)].copy_(tokens)
            return tokens
        flat, rows = to_device([flat, rows], torch.long, self.device)   # one copy
        tokens = self.prev_sampled.index_select(0, rows)
        inputs.input_ids.index_copy_(0, flat, tokens)
        return tokens

    def _pending_tokens(self, inputs: StepInputs, states: list[CachedRequestState], in_flight: torch.Tensor | None,
                        row_of: dict[str, int] | None = None):
        """(sample rows, token ids) of outputs still in flight, for penalties to count. row_of: each
        request's (first) sample row, where it is not its index among the sampled requests."""
        if in_flight is None or not any(s.sampling_params.uses_penalties for s in states):
            return None
        row_of = row_of or {r: i for i, r in enumerate(inputs.sample_req_ids)}
        return to_device([row_of[r] for _, r in inputs.placeholders], torch.long, self.device), in_flight

    def _pending_output(self, out: ModelRunnerOutput, req_ids: list[str], states: list[CachedRequestState],
                        sampled: torch.Tensor, lp_rows) -> PendingOutput:
        """Copy the results to the host behind the step's work and fill `out` once they are there."""
        event = None
        if self.device.type == "cuda":   # non-blocking copies to the host land in pinned memory
            # on a side stream: the next step's work queues right behind this one's sampling
            side = copy_stream(self.device, "out")
            side.wait_stream(torch.cuda.current_stream(self.device))
            on_device = [sampled, *(lp_rows or ())]
            with torch.cuda.stream(side):
                sampled = sampled.to("cpu", non_blocking=True)
                lp_rows = None if lp_rows is None else tuple(t.to("cpu", non_blocking=True) for t in lp_rows)
                event = torch.cuda.Event()
                event.record(side)
            for t in on_device:   # not reused before the copies read them
                t.record_stream(side)

        def finish() -> None:
            if event is not None:
                event.synchronize()
            for row, (req_id, token, state) in enumerate(zip(req_ids, sampled.tolist(), states)):
                out.sampled_token_ids[req_id] = [token]
                k = state.sampling_params.logprobs
                if k is not None and lp_rows is not None:
                    out.logprobs[req_id] = _rows_to_lists(lp_rows[0][row], lp_rows[1][row], lp_rows[2][row], k)
        return PendingOutput(out, finish)

    def _zero_fresh_blocks(self, sched: SchedulerOutput) -> None:
        fresh = [b for r in sched.scheduled_new_reqs for b in r.block_ids[r.num_computed_tokens // self.block_size:]]
        fresh += [b for r in sched.scheduled_cached_reqs for b in r.new_block_ids]
        if fresh:
            self._zero_blocks(fresh)

    def _zero_blocks(self, block_ids: list[int]) -> None:
        ids = to_device(block_ids, torch.long, self.device)
        for pool in self.kv_pools:
            self.backend.zero_blocks(pool, ids)

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Logprobs of each prompt token given the ones before it, for requests that asked."""
        for req_id, offset, n, ctx in zip(inputs.req_ids, inputs.token_offsets, inputs.attn.query_lens,
                                          inputs.attn.context_lens):
            state = self.states[req_id]
            k = state.sampling_params.prompt_logprobs
            # Position p predicts prompt token p + 1; only prompt positions count.
            last = min(ctx + n, state.num_prompt_tokens - 1)
            if k is None or last <= ctx:
                continue
            rows = hidden[offset:offset + (last - ctx)]
            logprobs = self.model.compute_logits(rows).float().log_softmax(dim=-1)
            targets = torch.tensor(state.token_ids[ctx + 1:last + 1], device=self.device)
            ids, lps, ranks = compute_logprobs(logprobs, targets, k)
            out.prompt_logprobs[req_id] = [_rows_to_lists(ids[i], lps[i], ranks[i], k) for i in range(len(targets))]
