"""Vocabulary-parallel embedding and LM head: each TP rank holds a contiguous slice of the vocab
(padded so the slices are equal); lookups outside the slice are masked to zero and summed across
ranks; logits are gathered back to the full vocabulary for sampling.

GGUF blocks: when a GGUF file is kept quantized, models/gguf_loader.py hands the embedding (and an
untied LM head) its raw blocks if their type is kept (quantization/gguf.py `kept_types`) and takes
the int8-activation CPU kernels (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) or the GPU keeps it. On the CPU
the table then stays in its blocks, regrouped once (kernels/cpu/quant_ops.py `repack`) into the
parameter itself, so a tied LM head shares the one copy: a lookup expands its rows, the LM head
multiplies the blocks. On CUDA an untied embedding whose type the GPU keeps (quantization/gguf.py
`gpu_keeps`: Q4_0, Q4_1, Q4_K by default) stays in its blocks as the linears hold them
(kernels/quant/gguf_layout.py `gpu_weight`, registered as `gguf_<plane>` parameters) and a lookup
expands its rows (`gguf_layout.rows`): an 8B Q4_K table takes 0.33 GB instead of 1.05. The LM head
and a tied table are dequantized into the dense table there (the LM head multiplies every row each
step: bf16 is its fast path), as is every other case.

A quantized LM head (a GPTQ checkpoint with `quantization_config.lm_head: true`, as GPTQModel and
AutoRound write it, `lm_head.qweight` ...): while the model is built under a format whose factory says
the head is quantized (layers/linear.py `quant_method_for`), ParallelLMHead holds no dense table but
a column-parallel linear of that format over its vocab slice (`linear`), which loads `lm_head.*` and
computes the logits; on CUDA the INT4 kernels then read a quarter of the head's bytes per step."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.comm import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from shardserve.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from shardserve.kernels.cpu import quant_ops
from shardserve.kernels.quant import gguf_layout
from shardserve.layers.linear import ColumnParallelLinear, linear, quant_method_for
from shardserve.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    packed_weight_layout = "rows"   # how cpu_ops.pack_weights may store the table: rows for lookups

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.params_dtype = torch.get_default_dtype()
        self.per_rank = cdiv(num_embeddings, self.tp_size)
        self.vocab_start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if getattr(loaded, "gguf_type", None) is not None:
            self._load_blocks(param, loaded)
            return
        if loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding width {loaded.shape[1]} does not match hidden size {param.shape[1]}")
        rows = loaded[self.vocab_start:self.vocab_start + self.per_rank]
        param.data[:rows.shape[0]].copy_(rows)

    def _load_blocks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """loaded: uint8 [vocab, blocks, block bytes] tagged `.gguf_type` (see the module docstring)."""
        type_name = loaded.gguf_type
        raw = torch.zeros(self.per_rank, *loaded.shape[1:], dtype=torch.uint8)   # the last rank's padding: zeros
        rows = loaded[self.vocab_start:self.vocab_start + self.per_rank]
        raw[:rows.shape[0]] = rows
        raw = raw.view(self.per_rank, -1)
        # (the loader tags whether the CPU kernels or the GPU keep this type: quantization/gguf.py)
        if (param.device.type == "cuda" and type(self) is VocabParallelEmbedding and not getattr(param, "tied", False)
                and getattr(loaded, "gguf_gpu_keeps", False)):
            self._keep_on_gpu(param, raw.to(param.device), type_name)
            return
        if param.device.type != "cpu" or not getattr(loaded, "gguf_cpu_keeps", False):
            param.data.copy_(self._dequantized(raw, type_name).to(param.device))
            return
        param.data = quant_ops.repack(raw, type_name, self.embedding_dim)   # in place: a tied LM head follows
        param.gguf_type = type_name
        param.gguf_isa, param.gguf_act = quant_ops.isa(), quant_ops.activations()   # the switches, read at load

    def _dequantized(self, raw: torch.Tensor, type_name: str) -> torch.Tensor:
        """The table's fp32 values on the CPU: the native kernels' expansion where they are built, else
        the planes' torch expansion (the same values), a few thousand rows at a time."""
        if quant_ops.available():
            return quant_ops.dequantize(raw, type_name, self.embedding_dim)
        return torch.cat([gguf_layout.dequantize(gguf_layout.to_planes(raw[i:i + 4096], type_name, self.embedding_dim))
                          for i in range(0, raw.shape[0], 4096)])

    def _keep_on_gpu(self, param: nn.Parameter, raw: torch.Tensor, type_name: str) -> None:
        weight = gguf_layout.gpu_weight(raw, type_name, self.embedding_dim, exact=self.params_dtype == torch.float32)
        for name, tensor in weight.planes.items():
            plane = nn.Parameter(tensor, requires_grad=False)
            self.register_parameter(f"gguf_{name}", plane)
            weight.planes[name] = plane
        param.data = torch.empty(0, self.embedding_dim, dtype=param.dtype, device=param.device)   # no dense table
        param.gguf_gpu = weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        kept = getattr(self.weight, "gguf_gpu", None)
        if kept is not None:
            return gguf_layout.rows(kept, ids.reshape(-1)).view(*ids.shape, -1).to(self.params_dtype)
        gguf_type = getattr(self.weight, "gguf_type", None)
        if gguf_type is not None:
            out = quant_ops.rows(self.weight, gguf_type, self.embedding_dim, ids, self.per_rank)
            return out if self.params_dtype == torch.float32 else out.to(self.params_dtype)
        # bf16-stored rows (cpu_ops.pack_weights) are widened back to the fp32 the model computes in.
        out = F.embedding(ids, self.weight)
        return out.float() if getattr(self.weight, "stored_bf16_for_fp32", False) else out


class ParallelLMHead(VocabParallelEmbedding):
    packed_weight_layout = "packed"   # only multiplies: packed for the native kernel

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.linear = None
        if quant_method_for(self) is not None:   # the checkpoint's head is quantized (the module docstring)
            if num_embeddings % self.tp_size:
                raise ValueError(f"a quantized LM head's {num_embeddings} vocabulary rows do not split evenly over "
                                 f"tensor_parallel_size={self.tp_size}")
            self.linear = ColumnParallelLinear(embedding_dim, num_embeddings)
            self.register_parameter("weight", None)   # no dense table

    def parameter_name(self, checkpoint_name: str) -> str:
        """The parameter a checkpoint's `lm_head.<name>` loads into."""
        return "lm_head.linear." + checkpoint_name[len("lm_head."):] if self.linear is not None else checkpoint_name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        gguf_type = getattr(self.weight, "gguf_type", None)
        if self.linear is not None:
            logits = self.linear(hidden)
        elif gguf_type is not None:
            w = self.weight
            logits = quant_ops.linear_int8(hidden, w, gguf_type, self.per_rank, isa_name=w.gguf_isa, act=w.gguf_act)
        else:
            logits = linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings]
