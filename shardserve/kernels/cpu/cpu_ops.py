"""Native CPU kernels (csrc/cpu_ops.c), compiled with the system C compiler on first use.

Why C and ctypes rather than a torch extension: the kernels need no torch headers, so they build in
about a second with plain `cc`, the shared object is cached per source hash, and any x86 machine
with a compiler and AVX2 + FMA gets them. Where there is no compiler or no AVX2, or
SHARDSERVE_CPU_KERNELS=0, `available()` is False and callers keep their plain-torch path.

The kernel library links libgomp by soname; torch has already loaded its own libgomp.so.1, so both
share one OpenMP runtime and `torch.set_num_threads` governs the kernels too.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

from shardserve.config import cpu_flags
from shardserve.utils import cdiv

logger = logging.getLogger("shardserve")

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "cpu_ops.c")
_STACK_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "decoder_stack.c")   # linked into the same library
_ROUTE_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "moe_route.c")        # the same
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
_NEEDED_CPU_FLAGS = {"avx2", "fma", "f16c"}


def _cache_dir() -> str:
    root = os.environ.get("SHARDSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardserve")
    return os.path.join(root, "cpu_ops")


def build_library(compiler: str, source: str = _SOURCE, flags: list[str] = _FLAGS,
                  extra_sources: tuple[str, ...] = ()) -> str:
    """Compile `source` (and `extra_sources`, linked into the same library) once per (sources, flags)
    hash into the shardserve cache; the path of the .so."""
    h = hashlib.sha256(" ".join(flags).encode())
    for path in (source, *extra_sources):
        with open(path, "rb") as f:
            h.update(f.read())
    digest = h.hexdigest()[:16]
    out_dir = _cache_dir()
    name = os.path.splitext(os.path.basename(source))[0]
    target = os.path.join(out_dir, f"{name}-{digest}.so")
    if os.path.exists(target):
        return target
    os.makedirs(out_dir, exist_ok=True)
    # Build beside the target and rename, so concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, source, *extra_sources, "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as e:
        os.unlink(tmp)
        raise RuntimeError(f"{compiler} failed on {source}:\n{e.stderr}") from e
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SHARDSERVE_CPU_KERNELS", "1") == "0":
        return None
    missing = _NEEDED_CPU_FLAGS - cpu_flags()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if missing or not compiler:
        logger.info("CPU kernels off (%s); using plain torch",
                    f"CPU lacks {', '.join(sorted(missing))}" if missing else "no C compiler found")
        return None
    try:
        lib = ctypes.CDLL(build_library(compiler, extra_sources=(_STACK_SOURCE, _ROUTE_SOURCE)))
    except (OSError, RuntimeError) as e:
        logger.warning("CPU kernels off, build failed: %s", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.linear_packed.restype = None
    lib.linear_packed.argtypes = [ptr, i64, ptr, ctypes.c_int, ptr, ptr, i64, i64, i64, i64]
    lib.write_kv.restype = None
    f32 = ctypes.c_float
    lib.write_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ctypes.c_int, ptr, i64, i64, i64, i64, f32, f32]
    lib.paged_attention.restype = None
    lib.paged_attention.argtypes = [ptr, i64, ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr, i64,
                                    i64, i64, i64, i64, i64, i64, f32, i64, f32, f32]
    lib.rms_norm.restype = lib.silu_and_mul.restype = lib.rotary_neox.restype = None
    lib.rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.rms_norm_heads.restype = None
    lib.rms_norm_heads.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ctypes.c_float]
    lib.silu_and_mul.argtypes = [ptr, ptr, i64, i64]
    lib.rotary_neox.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64]
    lib.decoder_stack.restype = ctypes.c_int
    lib.decoder_stack.argtypes = [ptr, i64, ptr, ptr, ctypes.c_int, ptr, ptr, ptr, i64, ptr, ptr]
    lib.moe_route.restype = None
    lib.moe_route.argtypes = [ptr, ptr, i64, i64, i64, ctypes.c_int, ptr, ptr, ptr]
    return lib


def available() -> bool:
    return _library() is not None


def pack_weight(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Parameter:
    """[N, K] -> panels [ceil(N / 16), K, 16] of `dtype` (bf16 or fp32; the layout linear_packed
    reads, see cpu_ops.c), rows past N zero. The result remembers N as `.out_features`."""
    n, k = weight.shape
    padded = torch.zeros(cdiv(n, 16) * 16, k, dtype=dtype)
    padded[:n] = weight
    packed = torch.nn.Parameter(padded.view(-1, 16, k).transpose(1, 2).contiguous(), requires_grad=False)
    packed.out_features = n
    return packed


def pack_experts(weights: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Parameter:
    """A MoE layer's stacked expert matrices [E, N, K] -> [E, ceil(N / 16), K, 16], each expert
    packed as pack_weight packs one matrix; `.out_features` = N, `.logical_shape` = (E, N, K)."""
    packed = torch.nn.Parameter(torch.stack([pack_weight(w, dtype) for w in weights]), requires_grad=False)
    packed.out_features = weights.shape[1]
    packed.logical_shape = tuple(weights.shape)
    return packed


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  out_features: int | None = None) -> torch.Tensor:
    """x ([..., K], any float dtype, widened to fp32) @ W^T + bias (fp32, [N]) -> fp32 [..., N],
    W packed by pack_weight (or one expert of pack_experts, whose N is given as out_features)."""
    k = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.dtype != torch.float32 or x2.stride(-1) != 1:
        x2 = x2.to(torch.float32).contiguous()
    n = out_features or packed.out_features
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    _library().linear_packed(x2.data_ptr(), x2.stride(0), packed.data_ptr(), int(packed.dtype == torch.bfloat16),
                             None if bias is None else bias.data_ptr(), y.data_ptr(), n, x2.shape[0], n, k)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def handles(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels take these activations: fp32 on the CPU, kernels available."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """rmsnorm(x) * weight over the last dim; with residual, residual += x (in place) and that sum is
    normalised. x, residual: contiguous fp32; without residual x may also be [T, heads, D] heads
    packed in strided rows (q or k inside a fused qkv row: Qwen3's per-head norms), out contiguous."""
    h = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.float32)
    if not x.is_contiguous():
        _check_rows(x, "x")
        assert residual is None
        _library().rms_norm_heads(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), weight.data_ptr(),
                                  x.shape[0], x.shape[1], h, eps)
        return out
    _library().rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                        out.data_ptr(), x.numel() // h, h, eps)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for contiguous fp32 x."""
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=torch.float32)
    _library().silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d)
    return out


def rotary_neox_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place with [max_pos, D / 2] fp32 cos/sin tables."""
    _check_rows(q, "q")
    _check_rows(k, "k")
    assert positions.dtype == torch.int64 and cos.is_contiguous() and sin.is_contiguous()
    positions = positions.contiguous()
    _library().rotary_neox(positions.data_ptr(), q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0),
                           k.shape[1], cos.data_ptr(), sin.data_ptr(), q.shape[0], q.shape[2])


def _check_rows(t: torch.Tensor, name: str) -> None:
    """[rows, heads, head_dim] with heads and head_dim packed (the row stride may be anything)."""
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.dtype != torch.float32:
        raise ValueError(f"{name}: expected fp32 [rows, heads, head_dim] with packed heads, got "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")


# The pool dtypes the kernels read and write (cpu_ops.c's KV_F32, KV_BF16, KV_FP8).
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store new tokens' k, v ([T, Hk, D] fp32) at `slots` of a [Hk, blocks, block_size, D] pool
    (fp32, bf16, or fp8 E4M3 holding k / k_scale and v / v_scale: kernels/attention/kv_fp8.py)."""
    _check_rows(k, "k")
    _check_rows(v, "v")
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots.dtype == torch.int64
    slots = slots.contiguous()
    hk, blocks, block_size, dim = k_cache.shape
    _library().write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                        v_cache.data_ptr(), KV_KINDS[k_cache.dtype], slots.data_ptr(), k.shape[0],
                        hk, dim, blocks * block_size, k_scale, v_scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, spec) -> None:
    """out[b] = attention of query b (q[b], [B, Hq, D]) over the first seq_lens[b] tokens of the
    sequence whose block table is block_tables[b]. An fp8 pool is read times spec.k_scale / v_scale."""
    _check_rows(q, "q")
    _check_rows(out, "out")
    assert block_tables.dtype == torch.int32 and block_tables.is_contiguous()
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    hk, blocks, block_size, dim = k_cache.shape
    _library().paged_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), KV_KINDS[k_cache.dtype],
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), out.stride(0),
        q.shape[0], q.shape[1], hk, dim, block_size, blocks * block_size, spec.scale, spec.sliding_window or 0,
        spec.k_scale, spec.v_scale)


def decoder_stack(*args) -> int:
    """csrc/decoder_stack.c's entry point (kernels/cpu/decoder_stack.py builds its arguments)."""
    return _library().decoder_stack(*args)


def moe_route(*args) -> None:
    """csrc/moe_route.c's entry point (kernels/cpu/moe_route.py builds its arguments)."""
    _library().moe_route(*args)


def pack_weights(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Pack the weight of every linear layer and LM head of `model` (fp32 modules: bf16 or fp32
    values) into `dtype` panels for linear_packed; with bf16, embedding tables are stored as bf16
    rows for lookups too. The values do not change (bf16 weights already hold bf16-rounded values in
    fp32), only their layout and size. A tied embedding and LM head get one copy of each layout.
    A MoE layer names its stacked expert weights in `packed_expert_weights` (pack_experts).
    Returns how many matrices were converted."""
    done: dict[tuple[int, str], torch.nn.Parameter] = {}
    originals = []   # keeps the fp32 parameters alive while ids are used as keys
    experts = 0
    for module in model.modules():
        for name in getattr(module, "packed_expert_weights", ()):
            stacked = getattr(module, name)
            if stacked.dtype == torch.float32 and stacked.dim() == 3:
                setattr(module, name, pack_experts(stacked.detach(), dtype))
                experts += stacked.shape[0]
        layout = getattr(module, "packed_weight_layout", None)
        weight = getattr(module, "weight", None)
        if layout is None or weight is None or (layout == "rows" and dtype != torch.bfloat16):
            continue
        key = (id(weight), layout)
        if key not in done:
            if weight.dtype != torch.float32:
                continue
            originals.append(weight)
            if layout == "packed":
                done[key] = pack_weight(weight.detach(), dtype)
            else:
                done[key] = torch.nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)
                done[key].stored_bf16_for_fp32 = True
        module.weight = done[key]
    return len(done) + experts
