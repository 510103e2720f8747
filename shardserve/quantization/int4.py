"""INT4 weight-only (W4A16) checkpoints: GPTQ and AWQ, read as the tools write them (`quant_method:
gptq | awq`); and 8-bit GPTQ (`bits: 8`: Qwen's `*-GPTQ-Int8`), four values per word (zeros v1:
stored + 1 modulo 256), dequantized once after loading on every device (the 4-bit kernels do not
take them: INT8's accuracy, not its memory saving). Nothing here quantizes a full-precision model.

Both store, per linear layer with K inputs and N outputs, 4-bit values q with a zero point z and a
scale s per group of `group_size` inputs and per output: w[n, k] = (q[k, n] - z[g, n]) * s[g, n].
Eight 4-bit values are packed into one int32, low bits first. `scales` is fp16 [groups, N] and
`qzeros` int32 [groups, N / 8] (packed along N) in both; they differ in:
- GPTQ (AutoGPTQ, optimum, GPTQModel): `qweight` int32 [K / 8, N], packed along K. The group of
  input k is k // group_size, except with `desc_act` (activation order), where `g_idx` int32 [K]
  names it (the checkpoint keeps the original input order). `checkpoint_format: gptq` (v1, the
  default and what Hub checkpoints carry) stores zero - 1 (modulo 16), so z = (stored + 1) & 15;
  `gptq_v2` (GPTQModel) stores z itself. `group_size: -1` is one group over all inputs; a K that is
  not a multiple of the group has a last, shorter group (AutoGPTQ's ceil(K / group_size) rows).
- AWQ (AutoAWQ `version: gemm`, zero_point): `qweight` int32 [K, N / 8], packed along N like the
  zeros, each word holding its 8 outputs interleaved: nibble i is output 8c + AWQ_ORDER[i]. No g_idx.

Sharding: N is the output dim (column, merged and QKV layers split it; the packed qzeros and AWQ
qweight with pack_factor 8, so each fused part's rows per rank must be a multiple of 8), K the
input dim (row-parallel layers split qweight and g_idx). A row-parallel rank holds only its own
groups when its inputs start and end on group boundaries; otherwise (desc_act, group_size -1, or
K / TP not a multiple of group_size) it holds every group's scales and zeros (about 1/16 of the
packed weight at group 128) and picks its inputs' groups by global index, so any TP size the model
allows works. Scales are held in fp32 (exact for fp16 or bf16 checkpoints).

Running: on the CPU the weights are dequantized once, after loading, into an ordinary weight of
the layer's dtype, so every native CPU kernel and the weight packing run unchanged: the accuracy of
INT4, not its memory saving. On CUDA the weights stay 4-bit (the memory saving), repacked once into
the Triton W4A16 kernels' layout (kernels/quant/int4_layout.py: one 512-byte load per row brings
1024 inputs at group 128; fp16 scales and uint8 zeros per group; a `desc_act` checkpoint's inputs
sorted by group, the activations gathered into that order at each call). `apply` then runs, by
rows: 1-4 the tensor-core GEMV (kernels/quant/triton_w4a16_gemv.py, or the FMA one where the tuned
table says so; the gate_up pair with its SiLU-and-mul in one kernel), up to DOT_MAX_ROWS the
tensor-core W4A16 kernel, more a dequantize-into-bf16 kernel then cuBLAS. Groups the
kernels cannot tile (other than 32, 64 or a multiple of 128 inputs, or a row-parallel shard whose
inputs cut groups or pick them out of order) keep the checkpoint's packing and are dequantized with torch ops at every
call (graph-safe, slow).

GPTQ's `lm_head: true` (GPTQModel, AutoRound): the LM head is one more INT4 layer, column-parallel
over the vocabulary (layers/vocab.py); a tied embedding cannot share it (refused).

GPTQModel's `dynamic` (regexes from the start of the HF module name, the first match deciding):
"-:pattern" leaves layers unquantized (plain `weight`), "+:pattern" or a bare one gives them their
own bits (4 or 8), group_size or desc_act (`GptqConfig.scheme_for`). AWQ's `modules_to_not_convert`
(transformers' rule, stored.left_out) leaves layers in 16 bits. models/loader.place_schemes gives
those layers their method before loading (fused parts must agree, and all of a MoE layer's experts).

Refused at start-up, naming the key: bits other than 4 (GPTQ: 4 or 8); 8-bit MoE experts; GPTQ
checkpoint_format other than gptq and gptq_v2 (marlin repacks); AWQ versions other than gemm (gemv
packs differently), zero_point false. MoE experts in INT4 are quantization/int4_moe.py's.
"""
from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.kernels.quant import int4_layout, reference, triton_w4a16, triton_w4a16_gemv, tuned
from shardserve.layers.linear import LinearBase, LinearMethod, RowParallelLinear, linear
from shardserve.quantization.stored import left_out, left_out_patterns

PACK = 8                                  # 4-bit values per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # nibble i of an AWQ word holds output 8c + AWQ_ORDER[i]
DOT_MAX_ROWS = 64                         # more rows: dequantize into bf16, then cuBLAS (BENCHMARKS.md, session 36)


def unpack_int4(packed: torch.Tensor, dim: int, interleaved: bool = False, bits: int = 4) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (0..15, low bits first) along `dim` (0 or 1), as
    int32 of 8x that size (bits=8: four 8-bit values, 0..255). interleaved: AWQ's order within each
    word (along dim 1, 4-bit)."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    if dim == 0:
        values = (packed.unsqueeze(1) >> shifts.view(1, per_word, 1)) & mask    # [R, 8, C]
        return values.reshape(packed.shape[0] * per_word, packed.shape[1])
    values = (packed.unsqueeze(2) >> shifts) & mask                             # [R, C, 8]
    if interleaved:   # nibbles 0-3 hold the even outputs, 4-7 the odd ones: output 2m + h is nibble 4h + m
        values = values.view(*values.shape[:2], 2, 4).transpose(2, 3)
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_index: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """q [K, N] and per-group zeros, scales [groups, N] -> the weight [N, K] (a transposed view) in
    `dtype`, computed in fp32 and rounded once. group_index [K]: the row of zeros/scales per input."""
    z = zeros.index_select(0, group_index)
    s = scales.index_select(0, group_index).float()
    return ((q - z).float() * s).to(dtype).t()


def held_bytes_per_weight(group_size: int, k: int) -> float:
    """Bytes a CUDA INT4 layer holds per weight in the kernels' layout: half a byte, plus an fp16
    scale and a uint8 zero per group (group_size -1: one group over the k inputs)."""
    return 0.5 + 3 / (k if group_size == -1 else group_size)


def _bits(cfg: dict[str, Any], fmt: str, *keys: str, allowed: tuple[int, ...] = (4,)) -> int:
    for key in keys:
        if key in cfg:
            if cfg[key] not in allowed:
                raise ValueError(f"{fmt} checkpoints with quantization_config.{key}={cfg[key]} are not supported; "
                                 f"only {' and '.join(f'{b}-bit' for b in allowed)} ones are")
            return cfg[key]
    raise ValueError(f"{fmt} quantization_config has no 'bits' key")


def _group_size(cfg: dict[str, Any], fmt: str, *keys: str) -> int | None:
    key = next((k for k in keys if k in cfg), keys[0])
    size = cfg.get(key, 128)
    if size == -1:
        return None
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"{fmt} quantization_config.{key}={size!r} is not supported; give a positive group size "
                         "or -1 (one group per output)")
    return size


def same_order_for_every_part(g_idx: nn.Parameter) -> None:
    """Fused parts (q/k/v, gate/up) share one g_idx: they see the same inputs, so GPTQ orders them
    alike. Refuse a checkpoint whose parts disagree rather than run on the wrong groups."""
    load = g_idx.weight_loader

    def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if getattr(param, "int4_loaded", False) and not torch.equal(param.data, loaded.to(param.data)):
            raise ValueError(f"g_idx of part {shard_id!r} differs from the other fused parts' (activation order "
                             "with different input orders per part is not supported)")
        load(param, loaded, shard_id)
        param.int4_loaded = True

    g_idx.weight_loader = loader


class Int4Config:
    name = "int4"
    lm_head = False   # GPTQ's lm_head: true quantizes the LM head too

    def __init__(self, group_size: int | None, desc_act: bool = False, zero_offset: int = 0, bits: int = 4) -> None:
        self.group_size = group_size     # None: one group over all inputs
        self.desc_act = desc_act         # GPTQ activation order: inputs' groups from g_idx
        self.zero_offset = zero_offset   # GPTQ v1 stores zero - 1
        self.bits = bits                 # 8: GPTQ only, dequantized after loading

    def linear_method(self, layer: LinearBase) -> LinearMethod | None:
        return Int4LinearMethod(self)


GptqScheme = tuple[int, "int | None", bool]   # (bits, group_size, desc_act) of one layer


class GptqConfig(Int4Config):
    name = "gptq"
    dynamic: tuple[tuple[str, dict[str, Any]], ...] = ()   # GPTQModel's per-module overrides, in order

    @classmethod
    def from_quantization_config(cls, cfg: dict[str, Any]) -> "GptqConfig":
        bits = _bits(cfg, "GPTQ", "bits", allowed=(4, 8))
        fmt = cfg.get("checkpoint_format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ quantization_config.checkpoint_format={fmt!r} is not supported; "
                             "'gptq' (v1) and 'gptq_v2' are")
        if cfg.get("pack_dtype", "int32") != "int32":
            raise ValueError(f"GPTQ quantization_config.pack_dtype={cfg['pack_dtype']!r} is not supported; only "
                             "int32 words are")
        config = cls(_group_size(cfg, "GPTQ", "group_size"), bool(cfg.get("desc_act", False)),
                     zero_offset=1 if fmt == "gptq" else 0, bits=bits)
        config.lm_head = bool(cfg.get("lm_head", False))
        config.dynamic = tuple((pattern, _override(pattern, o)) for pattern, o in (cfg.get("dynamic") or {}).items())
        return config

    @property
    def scheme(self) -> GptqScheme:
        """The layers' scheme while the model is built (models/loader.place_schemes compares)."""
        return self.bits, self.group_size, self.desc_act

    def scheme_for(self, name: str) -> GptqScheme | None:
        """Layer `name`'s scheme (an HF module name, "lm_head" for the head; None: stored unquantized):
        the first `dynamic` pattern matching the name from its start decides, as GPTQModel and vLLM
        read them: "-:" leaves the layer out, "+:" (or no prefix) overrides bits, group_size, desc_act."""
        if name == "lm_head" and not self.lm_head:
            return None
        for pattern, override in self.dynamic:
            if re.match(pattern.removeprefix("-:").removeprefix("+:"), name):
                if pattern.startswith("-:"):
                    return None
                return (override.get("bits", self.bits), override.get("group_size", self.group_size),
                        override.get("desc_act", self.desc_act))
        return self.scheme

    def for_scheme(self, scheme: GptqScheme | None) -> "GptqConfig":
        """This config with a `dynamic` override's bits, group_size and desc_act (None: as built)."""
        if scheme is None or scheme == self.scheme:
            return self
        config = GptqConfig(scheme[1], scheme[2], self.zero_offset, scheme[0])
        config.lm_head = self.lm_head
        return config

    def linear_method(self, layer: LinearBase, scheme: GptqScheme | None = None) -> LinearMethod | None:
        return Int4LinearMethod(self.for_scheme(scheme))


def _override(pattern: str, override: Any) -> dict[str, Any]:
    """A `dynamic` entry's overrides, checked: bits 4 or 8, group_size (-1: one group), desc_act;
    other keys (sym, damp_percent ...) change how the tool quantized, not how the weights are stored."""
    if not isinstance(override, dict):
        raise ValueError(f"GPTQ quantization_config.dynamic[{pattern!r}] must be a dict of overrides")
    try:
        re.compile(pattern.removeprefix("-:").removeprefix("+:"))
    except re.error as e:
        raise ValueError(f"GPTQ dynamic pattern {pattern!r} is not a regular expression: {e}") from None
    out: dict[str, Any] = {}
    if "bits" in override:
        out["bits"] = _bits(override, f"GPTQ dynamic[{pattern!r}]", "bits", allowed=(4, 8))
    if "group_size" in override:
        out["group_size"] = _group_size(override, f"GPTQ dynamic[{pattern!r}]", "group_size")
    if "desc_act" in override:
        out["desc_act"] = bool(override["desc_act"])
    return out


class AwqConfig(Int4Config):
    name = "awq"
    skip: tuple[str, ...] = ()   # `modules_to_not_convert`: stored as plain `weight` (AutoAWQ's ["gate"]: MoE routers)

    @classmethod
    def from_quantization_config(cls, cfg: dict[str, Any]) -> "AwqConfig":
        _bits(cfg, "AWQ", "bits", "w_bit")
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ quantization_config.version={cfg['version']!r} is not supported; only 'gemm' "
                             "checkpoints are (GEMV and other variants pack their weights differently)")
        if not cfg.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points (quantization_config.zero_point=false) are not "
                             "supported")
        config = cls(_group_size(cfg, "AWQ", "group_size", "q_group_size"))
        config.skip = left_out_patterns(cfg, "modules_to_not_convert")
        return config

    def ignores(self, name: str) -> bool:
        """Whether `modules_to_not_convert` leaves layer `name` unquantized (models/loader.place_schemes)."""
        return left_out(name, self.skip)


class Int4LinearMethod(LinearMethod):
    """One per layer: holds where this rank's inputs sit among the checkpoint's groups."""

    def __init__(self, config: Int4Config) -> None:
        self.config = config
        self.gptq = config.name == "gptq"
        self.packed_by_input = self.gptq   # the weight's words hold 8 inputs (GPTQ); AWQ's hold 8 outputs
        self.zeros_by_output = True        # the zero points' words hold 8 outputs
        self.bits = config.bits
        self.pack = 32 // config.bits      # values per word: 8 (4-bit), 4 (8-bit GPTQ)

    def _layout(self, layer: LinearBase) -> tuple[int, int | None]:
        """Checks the layer's shape against the packing; sets where this rank's inputs sit among the
        checkpoint's groups. Returns (groups held, their dim: 0 where this rank holds its own only)."""
        cfg, k = self.config, layer.input_size
        what = f"{cfg.name.upper()} {type(layer).__name__}"
        p = self.pack
        if self.zeros_by_output and any(size % p for size in layer.output_shard_sizes):
            raise ValueError(f"{what}: output rows per rank {layer.output_shard_sizes} must be multiples of {p} (the "
                             f"{self.bits}-bit zero points are packed {p} outputs to a word); use a smaller "
                             "tensor_parallel_size")
        row_split = isinstance(layer, RowParallelLinear) and layer.tp_size > 1
        if self.packed_by_input and k % p:
            raise ValueError(f"{what}: {k} inputs per rank are not a multiple of {p} ({cfg.name.upper()} packs {p} "
                             "inputs to a word); use a smaller tensor_parallel_size")
        self.offset = layer.tp_rank * k if row_split else 0   # this rank's first input
        k_full = k * layer.tp_size if row_split else k
        self.group = cfg.group_size or k_full
        self.own_groups = not cfg.desc_act and k % self.group == 0   # this rank's groups only
        groups = k // self.group if self.own_groups else -(-k_full // self.group)
        return groups, 0 if self.own_groups else None

    def create_weights(self, layer: LinearBase) -> None:
        k, n = layer.input_size, layer.output_size
        groups, group_dim = self._layout(layer)
        if self.gptq:
            layer.register_quant_param("qweight", torch.empty(k // self.pack, n, dtype=torch.int32), output_dim=1,
                                       input_dim=0, packed_dim=0, pack_factor=self.pack)
            g_idx = layer.register_quant_param("g_idx", torch.empty(k, dtype=torch.int32), output_dim=None,
                                               input_dim=0)
            if self.config.desc_act and len(layer.output_shard_sizes) > 1:
                same_order_for_every_part(g_idx)
        else:
            layer.register_quant_param("qweight", torch.empty(k, n // PACK, dtype=torch.int32), output_dim=1,
                                       input_dim=0, packed_dim=1, pack_factor=PACK)
        layer.register_quant_param("qzeros", torch.empty(groups, n // self.pack, dtype=torch.int32), output_dim=1,
                                   input_dim=group_dim, packed_dim=1, pack_factor=self.pack)
        layer.register_quant_param("scales", torch.empty(groups, n, dtype=torch.float32), output_dim=1,
                                   input_dim=group_dim, full_precision=True)

    def checkpoint_tensors(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                               torch.Tensor | None]:
        """(packed weight as the checkpoint packs it, zeros 0..15 (8-bit: 0..255) [groups, N], fp32
        scales [groups, N], g_idx or None), taken off the layer."""
        zeros = unpack_int4(layer.qzeros.data, 1, interleaved=not self.gptq, bits=self.bits)
        zeros = (zeros + self.config.zero_offset) & ((1 << self.bits) - 1)
        out = layer.qweight.data, zeros, layer.scales.data, layer.g_idx.data if self.config.desc_act else None
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        return out

    def _group_index(self, g_idx: torch.Tensor | None, k: int, groups: int, device: torch.device) -> torch.Tensor:
        if g_idx is not None:   # desc_act: this rank's inputs, global group numbers
            index = g_idx.long()
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= groups):
                raise ValueError(f"{self.config.name.upper()} g_idx names groups outside 0..{groups - 1}")
            return index
        first = self.offset // self.group if self.own_groups else 0
        return torch.arange(self.offset, self.offset + k, device=device) // self.group - first

    def process_after_loading(self, layer: LinearBase) -> None:
        qweight, zeros, scales, g_idx = self.checkpoint_tensors(layer)
        index = self._group_index(g_idx, layer.input_size, scales.shape[0], qweight.device)
        self.kernel_group: int | None = None
        if self.bits != 4 or not self._keep_packed(qweight):
            w = dequantize(self._unpack(qweight), zeros, scales, index, layer.params_dtype)
            layer.weight = nn.Parameter(w.contiguous(), requires_grad=False)
            return
        order = self._kernel_order(index)
        if order is None:   # kept as the checkpoint packs it; dequantized at every call (the module docstring)
            layer.qweight = nn.Parameter(qweight, requires_grad=False)
            layer.int4_zeros = nn.Parameter(zeros, requires_grad=False)
            layer.int4_scales = nn.Parameter(scales, requires_grad=False)
            layer.register_buffer("int4_group_index", index, persistent=False)
            return
        perm, first, groups, (self.kernel_group, self.kernel_run) = order
        q = self._unpack(qweight)
        layer.qweight = nn.Parameter(int4_layout.pack(q if perm is None else q.index_select(0, perm), self.kernel_run),
                                     requires_grad=False)
        layer.int4_scales = nn.Parameter(int4_layout.compact_scales(scales[first:first + groups]), requires_grad=False)
        layer.int4_zeros = nn.Parameter(zeros[first:first + groups].to(torch.uint8), requires_grad=False)
        layer.register_buffer("int4_perm", perm, persistent=False)

    def _kernel_order(self, index: torch.Tensor) -> tuple[torch.Tensor | None, int, int, tuple[int, int]] | None:
        """(input order or None, first group, groups, the kernels' group size and run) when the
        kernels can take this layer: in that order, input k's group is first + k // group_size."""
        perm = None
        if self.config.desc_act:   # inputs sorted by group make each group a run again
            perm = torch.argsort(index, stable=True)
            index = index.index_select(0, perm)
            if torch.equal(perm, torch.arange(perm.numel(), device=perm.device)):
                perm = None
        k = index.numel()
        group = int4_layout.kernel_group(self.group, k)
        if group is None or k == 0:
            return None
        first = int(index[0])
        if not torch.equal(index, torch.arange(k, device=index.device) // self.group + first):
            return None
        return perm, first, int(index[-1]) - first + 1, group

    @staticmethod
    def _keep_packed(qweight: torch.Tensor) -> bool:
        """On CUDA (the memory saving); the tests force it on the CPU too, to check `apply`'s path."""
        return qweight.is_cuda

    def _unpack(self, qweight: torch.Tensor) -> torch.Tensor:
        return unpack_int4(qweight, 0, bits=self.bits) if self.gptq else unpack_int4(qweight, 1, interleaved=True)

    def _kernel_input(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if layer.int4_perm is not None:
            x2 = x2.index_select(1, layer.int4_perm)
        return x2 if x2.stride(-1) == 1 else x2.contiguous()

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if getattr(layer, "int4_scales", None) is None:   # dequantized after loading (CPU)
            return linear(x, layer.weight, bias)
        if self.kernel_group is None:
            w = dequantize(self._unpack(layer.qweight), layer.int4_zeros, layer.int4_scales, layer.int4_group_index,
                           x.dtype)
            return F.linear(x, w, bias)
        x2 = self._kernel_input(layer, x)
        args = (layer.qweight, layer.int4_scales, layer.int4_zeros, layer.input_size, self.kernel_group,
                self.kernel_run)
        rows = x2.shape[0]
        if not x2.is_cuda or x2.dtype not in (torch.bfloat16, torch.float16) or rows == 0 or not tuned.ENABLED:
            w = reference.int4_weight(*args, dtype=x.dtype)
            out = F.linear(x2, w, bias)
        elif rows <= triton_w4a16_gemv.MAX_ROWS:
            out = triton_w4a16_gemv.gemv(x2, *args, bias=bias)
        elif rows <= DOT_MAX_ROWS:
            out = triton_w4a16.matmul_dot(x2, *args, bias=bias)
        else:
            out = F.linear(x2, triton_w4a16.dequantize(*args, dtype=x.dtype), bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    def apply_gated(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        if (self.kernel_group is None or not tuned.ENABLED or not x.is_cuda or x.dim() != 2
                or x.dtype not in (torch.bfloat16, torch.float16) or not 0 < x.shape[0] <= triton_w4a16_gemv.MAX_ROWS):
            return None
        return triton_w4a16_gemv.gemv(self._kernel_input(layer, x), layer.qweight, layer.int4_scales, layer.int4_zeros,
                                     layer.input_size, self.kernel_group, self.kernel_run, gated=True)
