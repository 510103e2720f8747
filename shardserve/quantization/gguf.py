"""GGUF weights kept in their block formats (`quantization_config.quant_method: gguf`, which
models/gguf_loader.py writes into the config it synthesises for a .gguf file unless
SHARDSERVE_GGUF_DEQUANTIZE=1). The default since the int8 dot-product kernels: on the embedded
model they decode faster than the dequantized bf16 panels (and llama.cpp), batch faster, and hold a
third of the bytes (benchmarks/BENCHMARKS.md, issue 25 session 16).

- What stays quantized: the decoder's linear layers (q/k/v, o, gate/up, down) whose GGUF type
  `kept_types()` names (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), where the layer's device has kernels:
  - CPU (the native kernels, kernels/cpu/quant_ops.py): regrouped into 8-row groups (the file's
    bytes; Q4_K / Q5_K's 6-bit scales and mins unpacked to bytes) for the int8-activation kernels
    (`linear_int8`); under SHARDSERVE_GGUF_ACTIVATIONS=fp32 they hold the file's rows, uint8
    [N, row bytes], multiplied with fp32 activations. A fused q/k/v or gate/up whose parts differ in
    type (Q4_K_M's v and up in Q6_K) keeps one run of rows per type, each its own blocks and kernel
    call writing its columns of the one output (a gate/up so kept has no gated kernel: then
    SiLU-and-mul; the decoder stack chains the same calls). The token embedding (and an untied LM head)
    stays in its blocks too where its type is kept and takes the int8 kernels (layers/vocab.py), and
    so do MoE experts (quantization/gguf_moe.py); norms and MoE routers are dequantized at load.
  - CUDA (`gpu_keeps`: Q4_0, Q4_1 and Q4_K by default, every type with SHARDSERVE_GGUF_DEQUANTIZE=0):
    those three in the W4A16 kernels' layout (an fp32 model's Q4_K as planes: exact), the others
    with each field of the blocks in a plane of its own (kernels/quant/gguf_layout.py), dequantized
    in registers inside the matmul (kernels/quant/triton_gguf.py); a fused q/k/v or gate/up whose
    parts differ in type (Q4_K_M's v in Q6_K) keeps one run of rows per type, a run whose type is
    not kept as dense rows. An untied token embedding of a kept type stays in its blocks too
    (layers/vocab.py), and MoE experts of Q4_0 / Q4_1 / Q4_K in the INT4 experts' layout
    (quantization/gguf_moe.py); the LM head is dequantized after loading there.
- Dequantized after loading (into the layer's dtype), per layer: other GGUF types (F32, F16, BF16,
  Q5_0, ...; on the CPU a fused layer with a part of such a type as a whole, on CUDA that part's
  rows alone; a debug log line says which), and every CPU layer where the native kernels are off
  (no compiler, SHARDSERVE_CPU_KERNELS=0).
- Sharding: the loader hands each linear its tensor as uint8 [rows, blocks, block bytes], so the
  layers' own loaders slice rows for column parallelism (fused parts included) and whole blocks along
  K for row parallelism; a row-parallel split that would cut a block (K / TP not a multiple of 32,
  or of 256 for the K-quants) is refused with the TP sizes that work.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.kernels.cpu import quant_ops
from shardserve.kernels.cpu.decoder_stack import StackLinear, chained, panels_linear
from shardserve.kernels.quant import gguf_layout, gguf_matmul, reference, triton_gguf, tuned
from shardserve.layers.linear import LinearBase, LinearMethod, MergedColumnParallelLinear, QKVParallelLinear, linear

logger = logging.getLogger("shardserve")

# The file's unquantized float types, as raw bytes: (values per "block", bytes per block, torch dtype).
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


DEQUANTIZE_SWITCH = "SHARDSERVE_GGUF_DEQUANTIZE"
# Kept in their blocks by default: the types whose int8 dot-product kernels decode faster than the
# dequantized bf16 panels, which is all of them (K-quants 1.9-2.4x; benchmarks/BENCHMARKS.md, issue 25).
DEFAULT_KEPT = quant_ops.INT8_TYPES


def kept_types() -> tuple[str, ...]:
    """The GGUF types whose linears (and MoE experts) the loader hands over as raw blocks, for the
    layer to keep where its device has kernels for them (`process_after_loading`).
    SHARDSERVE_GGUF_DEQUANTIZE unset: DEFAULT_KEPT; 0: every type the kernels take; 1: none."""
    switch = os.environ.get(DEQUANTIZE_SWITCH)
    if switch not in (None, "", "0", "1"):
        raise ValueError(f"{DEQUANTIZE_SWITCH}={switch!r}: use 1 (dequantize GGUF weights at load) or 0 (keep them "
                         "in their blocks wherever the CPU kernels can; unset: where the int8 kernels can)")
    if switch == "1":
        return ()
    return tuple(quant_ops.TYPES) if switch == "0" else DEFAULT_KEPT


def cpu_keeps(type_name: str) -> bool:
    """Whether a CPU layer keeps blocks of this type: a kept type and the native kernels built (no
    compiler or SHARDSERVE_CPU_KERNELS=0: dequantized after loading)."""
    return type_name in kept_types() and quant_ops.available()


def cpu_keeps_table(type_name: str) -> bool:
    """Whether a CPU embedding or LM head keeps blocks of this type: a kept type the int8-activation
    kernels take, built, and not SHARDSERVE_GGUF_ACTIVATIONS=fp32 (layers/vocab.py)."""
    return (type_name in quant_ops.INT8_TYPES and type_name in kept_types() and quant_ops.activations() != "fp32"
            and quant_ops.available())


# Kept in their blocks on CUDA by default: the 4-bit types with a scale per 32 values, on the W4A16
# kernels (an 8B Q4_0 file decodes 1.84x faster than bf16 on an H100, Q4_1 and Q4_K as fast per
# layer). The other types' planes kernels decode at about half bf16's speed: dequantized after
# loading unless SHARDSERVE_GGUF_DEQUANTIZE=0 asks for the memory (benchmarks/BENCHMARKS.md).
GPU_DEFAULT_KEPT = gguf_layout.INT4_TYPES


def gpu_keeps(type_name: str) -> bool:
    """Whether a CUDA layer keeps blocks of this type: GPU_DEFAULT_KEPT, or with
    SHARDSERVE_GGUF_DEQUANTIZE=0 every type the GPU kernels take (none with =1)."""
    if triton_gguf.triton is None or type_name not in kept_types():
        return False
    return type_name in (gguf_layout.TYPES if os.environ.get(DEQUANTIZE_SWITCH) == "0" else GPU_DEFAULT_KEPT)


_HOW = {"int16": "integer dot products with x rounded to ~16 bits per block of 32 (two int8 levels)",
        "int8": "integer dot products with x rounded to 8 bits per block of 32 (llama.cpp's numerics)",
        "fp32": "blocks expanded to fp32 against fp32 activations (exact)"}


def path_line(device: torch.device) -> str:
    """The start-up line of a GGUF file kept in its blocks (engine/args.py logs it)."""
    if device.type == "cuda":
        kept = gguf_layout.TYPES if os.environ.get(DEQUANTIZE_SWITCH) == "0" else GPU_DEFAULT_KEPT
        return (f"GGUF weights of types {', '.join(kept)} kept in their blocks, dequantized inside the matmul "
                "(Triton; Q4_0, Q4_1, Q4_K on the W4A16 kernels; more than 16 rows: dequantized per call for "
                f"cuBLAS), other types dequantized after loading ({DEQUANTIZE_SWITCH}=0 keeps every type: less "
                "memory, slower decode; =1 dequantizes all)")
    if not quant_ops.available():
        return "GGUF weights dequantized after loading: the native CPU kernels are off (no compiler or " \
               "SHARDSERVE_CPU_KERNELS=0)"
    act = quant_ops.activations()
    return (f"GGUF weights kept in their blocks, {_HOW[act]}, {quant_ops.isa()} kernels (they decode faster than "
            f"the dequantized bf16 panels; {DEQUANTIZE_SWITCH}=1 dequantizes at load, "
            f"{quant_ops.ACTIVATIONS_SWITCH}=int16|int8|fp32 picks the rounding of x)")


def block_size(type_name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGUF type."""
    if type_name in _FLOAT_TYPES:
        return 1, _FLOAT_TYPES[type_name].itemsize
    import gguf
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]


def dequantize_blocks(raw: torch.Tensor, type_name: str, k: int) -> torch.Tensor:
    """uint8 [rows, ...] raw blocks of `type_name` -> fp32 [rows, k] (on the CPU)."""
    raw = raw.detach().cpu().contiguous().view(raw.shape[0], -1)
    if type_name in _FLOAT_TYPES:
        return raw.view(_FLOAT_TYPES[type_name]).float().reshape(raw.shape[0], k)
    if type_name in quant_ops.TYPES and quant_ops.available():
        return quant_ops.dequantize(raw, type_name, k)
    import gguf
    values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(values).reshape(raw.shape[0], k)


class GgufConfig:
    name = "gguf"

    @classmethod
    def from_quantization_config(cls, cfg: dict[str, Any]) -> "GgufConfig":
        return cls()

    def linear_method(self, layer: LinearBase) -> LinearMethod | None:
        return GgufLinearMethod()


def _valid_tp_sizes(input_features: int, unit: int) -> list[int]:
    blocks = input_features // unit
    return [t for t in range(1, min(blocks, 64) + 1) if blocks % t == 0 and input_features % t == 0]


class GgufLinearMethod(LinearMethod):
    """One layer's raw GGUF blocks. Parts (q/k/v, gate/up) are collected per type while loading;
    `process_after_loading` keeps them as blocks where the kernels multiply every part's type (parts
    of different types: one run of rows per type)."""

    def __init__(self) -> None:
        self.type_name: str | None = None            # the kept type(s) after loading; None: a dense weight
        self.gpu_runs: list[tuple[slice, Any]] = []  # CUDA: runs of rows of one type (gguf_layout.gpu_weight)
        # CPU, a fused layer whose parts differ in type: (rows, type, blocks, int8 matmul or None) per run
        self.cpu_runs: list[tuple[slice, str, nn.Parameter, Any]] = []
        self.int8 = False                            # regrouped for the int8-activation kernels (quant_ops.repack)
        self.isa, self.act = "", ""                  # SHARDSERVE_CPU_ISA / _GGUF_ACTIVATIONS as read at load
        self._int8_matmul = None                     # quant_ops.int8_matmul for the regrouped weight
        self._int8_gated = None                      # its gated form, for a merged [gate, up] layer
        self._buffers: dict[str, torch.Tensor] = {}  # GGUF type -> [N, blocks, bytes] rows of the parts of that type
        self._parts: list[tuple[Any, str]] = []      # (shard id, type) as loaded

    def create_weights(self, layer: LinearBase) -> None:
        # The type (so the row width) is known only when the tensor arrives: a placeholder until then.
        param = layer.register_quant_param("weight", torch.empty(layer.output_size, 0, 0, dtype=torch.uint8),
                                           output_dim=0, input_dim=1)
        param.weight_loader = lambda p, loaded, shard_id=None: self._load(layer, loaded, shard_id)

    def _load(self, layer: LinearBase, loaded: torch.Tensor, shard_id) -> None:
        type_name = getattr(loaded, "gguf_type", None)
        if loaded.dtype != torch.uint8 or type_name is None or loaded.dim() != 3:
            raise ValueError("a GGUF-quantized layer takes raw GGUF blocks (uint8 [rows, blocks, bytes] tagged with "
                             f"their type), got {loaded.dtype} {tuple(loaded.shape)}")
        unit, nbytes = block_size(type_name)
        k = layer.input_size   # this rank's input features
        if k % unit:
            full = k * layer.tp_size
            raise ValueError(f"GGUF {type_name} weights come in blocks of {unit} values along the input features; "
                             f"splitting {full} input features over tensor_parallel_size={layer.tp_size} gives "
                             f"{k} per rank, which cuts a block. Tensor-parallel sizes that work for this layer: "
                             f"{_valid_tp_sizes(full, unit)} (or leave SHARDSERVE_GGUF_DEQUANTIZE at 1)")
        buffer = self._buffers.get(type_name)
        if buffer is None:
            buffer = torch.empty(layer.output_size, k // unit, nbytes, dtype=torch.uint8,
                                 device=layer.weight.device)
            self._buffers[type_name] = buffer
        target = nn.Parameter(buffer, requires_grad=False)   # shares the buffer: the layer's loader slices into it
        target.output_dim, target.input_dim, target.per_part = 0, 1, False
        target.packed_dim, target.pack_factor = None, 1
        layer.weight_loader(target, loaded, shard_id)
        self._parts.append((shard_id, type_name))

    def _part_rows(self, layer: LinearBase, shard_id) -> slice:
        sizes = layer.output_shard_sizes
        if shard_id is None:
            return slice(0, layer.output_size)
        index = QKVParallelLinear._PARTS[shard_id] if isinstance(shard_id, str) else int(shard_id)
        start = sum(sizes[:index])
        return slice(start, start + sizes[index])

    def _runs(self, layer: LinearBase) -> list[tuple[slice, str]]:
        """The loaded parts as runs of output rows of one type, in row order (neighbouring parts of
        one type merged: a q/k/v of one type is one run)."""
        runs: list[tuple[slice, str]] = []
        for rows, type_name in sorted(((self._part_rows(layer, s), t) for s, t in self._parts),
                                      key=lambda part: part[0].start):
            if runs and runs[-1][1] == type_name and runs[-1][0].stop == rows.start:
                rows = slice(runs.pop()[0].start, rows.stop)
            runs.append((rows, type_name))
        return runs

    def process_after_loading(self, layer: LinearBase) -> None:
        runs = self._runs(layer)
        types = {t for _, t in runs}
        device = layer.weight.device
        if runs and device.type == "cuda" and any(gpu_keeps(t) for t in types):
            self._keep_on_gpu(layer, runs)
        elif len(types) == 1 and device.type == "cpu" and cpu_keeps(next(iter(types))):
            self._keep_on_cpu(layer, next(iter(types)))
        elif runs and device.type == "cpu" and all(cpu_keeps(t) for t in types):
            self._keep_runs_on_cpu(layer, runs)
        else:
            if len(types) > 1:
                logger.debug("GGUF: %s has parts of types %s; dequantized", type(layer).__name__,
                             ", ".join(f"{s}={t}" for s, t in self._parts))
            dense = torch.empty(layer.output_size, layer.input_size, dtype=layer.params_dtype, device=device)
            if not self._parts:   # load_format="dummy": random weights, as init_dummy_weights draws them
                dense.normal_(0.0, 0.02)
            for shard_id, type_name in self._parts:
                rows = self._part_rows(layer, shard_id)
                values = dequantize_blocks(self._buffers[type_name][rows], type_name, layer.input_size)
                dense[rows] = values.to(device=device, dtype=layer.params_dtype)
            layer.weight = nn.Parameter(dense, requires_grad=False)
        self._buffers.clear()

    def _keep_on_gpu(self, layer: LinearBase, runs: list[tuple[slice, str]]) -> None:
        """Each run of rows as the GPU kernels take it (kernels/quant/gguf_layout.py `gpu_weight`:
        planes, or the W4A16 layout; an fp32 model's exact), or, where its type is not kept (Q4_K_M's
        Q6_K v or down by default), dequantized to dense rows of the layer's dtype; registered on the
        layer as parameters `gguf<run>_<tensor>` (memory accounting sees them); the placeholder
        weight stays empty."""
        self.type_name = "+".join(t for _, t in runs)
        exact = layer.params_dtype == torch.float32
        for i, (rows, type_name) in enumerate(runs):
            if not gpu_keeps(type_name):
                logger.debug("GGUF: rows %d-%d of %s (%s) dequantized", rows.start, rows.stop, type(layer).__name__,
                             type_name)
                dense = dequantize_blocks(self._buffers[type_name][rows], type_name, layer.input_size)
                param = nn.Parameter(dense.to(device=layer.weight.device, dtype=layer.params_dtype),
                                     requires_grad=False)
                layer.register_parameter(f"gguf{i}_dense", param)
                self.gpu_runs.append((rows, param))
                continue
            weight = gguf_layout.gpu_weight(self._buffers[type_name][rows], type_name, layer.input_size, exact)
            for name, tensor in weight.planes.items():
                param = nn.Parameter(tensor, requires_grad=False)
                layer.register_parameter(f"gguf{i}_{name}", param)
                weight.planes[name] = param
            self.gpu_runs.append((rows, weight))

    def _keep_on_cpu(self, layer: LinearBase, type_name: str) -> None:
        self.type_name = type_name
        raw = self._buffers[type_name].view(layer.output_size, -1)
        self.isa, self.act = quant_ops.isa(), quant_ops.activations()
        self.int8 = type_name in quant_ops.INT8_TYPES and self.act != "fp32"
        if self.int8:
            raw = quant_ops.repack(raw, type_name, layer.input_size)
        layer.weight = nn.Parameter(raw, requires_grad=False)
        if self.int8:
            args = (layer.weight, type_name, layer.output_size, layer.input_size, self.isa, self.act)
            self._int8_matmul = quant_ops.int8_matmul(*args)
            if isinstance(layer, MergedColumnParallelLinear) and len(layer.output_shard_sizes) == 2 \
                    and layer.output_shard_sizes[0] == layer.output_shard_sizes[1] and layer.output_size % 16 == 0:
                self._int8_gated = quant_ops.int8_matmul(*args, gated=True)

    def _keep_runs_on_cpu(self, layer: LinearBase, runs: list[tuple[slice, str]]) -> None:
        """A fused layer whose parts differ in type (Q4_K_M's v, or up, in Q6_K): each run of rows of
        one type kept as its own blocks, as _keep_on_cpu keeps a whole layer, registered on the layer
        as parameter `gguf<run>` (memory accounting sees them); the placeholder weight stays empty.
        `apply` writes each run's product into its columns of one output."""
        self.type_name = "+".join(t for _, t in runs)
        self.isa, self.act = quant_ops.isa(), quant_ops.activations()
        for i, (rows, type_name) in enumerate(runs):
            n = rows.stop - rows.start
            raw = self._buffers[type_name][rows].reshape(n, -1)
            int8 = type_name in quant_ops.INT8_TYPES and self.act != "fp32"
            # (the file's rows copied out of the buffer, which holds every row of the layer)
            param = nn.Parameter(quant_ops.repack(raw, type_name, layer.input_size) if int8 else raw.clone(),
                                 requires_grad=False)
            layer.register_parameter(f"gguf{i}", param)
            matmul = quant_ops.int8_matmul(param, type_name, n, layer.input_size, self.isa, self.act) if int8 else None
            self.cpu_runs.append((rows, type_name, param, matmul))

    def _apply_runs(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, layer.input_size)
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.to(torch.float32).contiguous()
        out = torch.empty(x2.shape[0], layer.output_size, dtype=torch.float32)
        for rows, type_name, weight, matmul in self.cpu_runs:
            b = None if bias is None else bias[rows]
            if matmul is not None:
                matmul(x2, b, out=out[:, rows])
            else:
                quant_ops.linear(x2, weight, type_name, b, self.isa, out=out[:, rows])
        return out.view(*x.shape[:-1], layer.output_size)

    def apply_gated(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        if self.gpu_runs:   # a 4-bit gate_up on CUDA: the W4A16 GEMV's gated form (SiLU-and-mul inside)
            return gguf_matmul.gated(x, self.gpu_runs, layer)
        if self._int8_gated is None:
            return None
        out = self._int8_gated(x)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def stack_linear(self, layer: LinearBase, gated: bool) -> StackLinear | None:
        bias = layer.bias
        if self.gpu_runs:
            return None
        if self.cpu_runs:   # a fused layer of several types: its runs in turn (no gated form: then silu_and_mul)
            if gated or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous())):
                return None
            parts = []
            for rows, type_name, weight, matmul in self.cpu_runs:
                part = quant_ops.stack_linear(weight, type_name, rows.stop - rows.start, layer.input_size, self.isa,
                                              self.act if matmul is not None else "fp32",
                                              bias=None if bias is None else bias[rows])
                part.col = rows.start
                parts.append(part)
            return chained(parts)
        if self.type_name is None:   # dequantized: packed panels like any dense layer
            return None if gated else panels_linear(layer.weight, layer.output_size, layer.input_size, bias)
        if (gated and self._int8_gated is None) or (bias is not None and bias.dtype != torch.float32):
            return None
        return quant_ops.stack_linear(layer.weight, self.type_name, layer.output_size, layer.input_size, self.isa,
                                      self.act if self.int8 else "fp32", gated, bias)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.gpu_runs:
            x2 = x.reshape(-1, x.shape[-1])
            x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
            if tuned.ENABLED and x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16, torch.float32):
                out = gguf_matmul.matmul(x2, self.gpu_runs, layer.output_size, bias)
            else:   # SHARDSERVE_QUANT_KERNELS=0: dequantize, then cuBLAS
                out = F.linear(x2, reference.gguf_weight(self.gpu_runs, layer.output_size, x2.dtype), bias)
            return out.view(*x.shape[:-1], layer.output_size)
        if self.type_name is None:
            return linear(x, layer.weight, bias)
        if self.cpu_runs:
            out = self._apply_runs(layer, x, bias)
        elif self.int8:
            out = self._int8_matmul(x, bias)
        else:
            out = quant_ops.linear(x, layer.weight, self.type_name, bias, self.isa)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
