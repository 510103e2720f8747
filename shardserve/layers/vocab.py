"""Vocabulary-parallel embedding and LM head: each TP rank holds a contiguous slice of the vocab
(padded so the slices are equal); lookups outside the slice are masked to zero and summed across
ranks; logits are gathered back to the full vocabulary for sampling."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.comm import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from shardserve.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from shardserve.layers.linear import linear
from shardserve.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    packed_weight_layout = "rows"   # how cpu_ops.pack_weights may store the table: rows for lookups

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.per_rank = cdiv(num_embeddings, self.tp_size)
        self.vocab_start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding width {loaded.shape[1]} does not match hidden size {param.shape[1]}")
        rows = loaded[self.vocab_start:self.vocab_start + self.per_rank]
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        # bf16-stored rows (cpu_ops.pack_weights) are widened back to the fp32 the model computes in.
        out = F.embedding(ids, self.weight)
        return out.float() if getattr(self.weight, "stored_bf16_for_fp32", False) else out


class ParallelLMHead(VocabParallelEmbedding):
    packed_weight_layout = "packed"   # only multiplies: packed for the native kernel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings]
