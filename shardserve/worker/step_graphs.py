"""The three CUDA-graph kinds behind one entry point: decode-only steps (cuda_graphs.DecodeGraphs),
short prefill-only steps (prefill_graphs.PrefillGraphs) and steps mixing the two
(piecewise_graphs.PiecewiseGraphs). `try_run` replays the graph that takes a step, or returns None
and the model runner runs it eagerly."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardserve.config import ModelConfig, SchedulerConfig
from shardserve.utils import cdiv
from shardserve.worker.cuda_graphs import DecodeGraphs
from shardserve.worker.input_batch import StepInputs

if TYPE_CHECKING:
    from shardserve.worker.piecewise_graphs import PiecewiseGraphs
    from shardserve.worker.prefill_graphs import PrefillGraphs


class StepGraphs:
    def __init__(self, model: torch.nn.Module, backend, device: torch.device, model_config: ModelConfig,
                 scheduler_config: SchedulerConfig, block_size: int, num_blocks: int) -> None:
        """Capture every kind the config asks for over a pool of num_blocks blocks (plus the scratch
        block past its end that padding rows write into)."""
        max_blocks, scratch = cdiv(scheduler_config.max_model_len, block_size), num_blocks * block_size
        # One memory pool, captured on one stream (a pool's blocks belong to a stream): one graph
        # replays at a time, so they can share their intermediate memory.
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        max_tokens = scheduler_config.max_num_batched_tokens
        self.decode = DecodeGraphs(model, backend, device, scheduler_config.max_num_seqs, max_blocks, block_size,
                                   scratch, pool, stream)
        self.prefill: PrefillGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if model_config.prefill_graphs:
            from shardserve.worker.prefill_graphs import PrefillGraphs  # imports Triton
            self.prefill = PrefillGraphs(model, backend, device, max_tokens, max_blocks, block_size, scratch, pool,
                                         stream)
        if model_config.piecewise_graphs:
            from shardserve.worker.piecewise_graphs import PiecewiseGraphs
            self.piecewise = PiecewiseGraphs(model, backend, device, max_tokens, block_size, scratch, pool, stream)

    def try_run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's hidden states from the graph that takes it; None where none does."""
        attn = inputs.attn
        if attn.num_decodes == len(inputs.req_ids) and self.decode.fits(attn.num_decodes):
            return self.decode.run(inputs.token_columns, attn.block_tables, inputs.seq_lens)
        if self.prefill is not None and self.prefill.fits(attn):
            return self.prefill.run(inputs.token_columns, attn)
        if self.piecewise is not None and self.piecewise.fits(attn):
            return self.piecewise.run(inputs.token_columns, attn)
        return None
