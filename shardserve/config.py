"""Engine configuration: frozen dataclasses validated on construction.

`EngineConfig.create(...)` is the one place that turns user arguments (the offline `LLM` kwargs and,
later, CLI flags) into validated configs. Errors name the argument at fault and what would work.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_size(value: int | str) -> int:
    """Parse a byte count: 4096, "4GiB", "512MiB", "2GB" (decimal), "1.5G" (binary)."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"cannot parse size {value!r}: use bytes or a unit like '4GiB', '512MiB'")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = "KMGT".index(unit) + 1 if unit else 0
    base = 1000 if (unit and not binary and str(value).strip().upper().endswith("B")) else 1024
    return int(number * base**power)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but no CUDA GPU is visible; use device='cpu'")
        if dev.index is None:   # memory queries need an explicit index
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | torch.dtype, model_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' follows the checkpoint's dtype (bf16 for GGUF), fp32 becomes bf16 on GPUs as in vLLM."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        chosen = model_dtype or torch.bfloat16
        if chosen == torch.float32 and device.type == "cuda":
            chosen = torch.bfloat16
        return chosen
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags /proc/cpuinfo lists (empty where it does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how: the resolved checkpoint path plus the HF-style config dict."""

    model: str                    # checkpoint dir or .gguf file, resolved
    served_model_name: str
    hf_config: dict[str, Any]     # config.json contents (synthesised for GGUF)
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    compute_dtype_override: torch.dtype | None = None   # CPU: see layers/cpu_path.py
    load_format: str = "auto"                          # "dummy": random weights, real shapes
    enforce_eager: bool = False                        # CUDA: no graphs at all
    # CUDA: graphs for short prefill-only steps / for steps mixing decodes and prefills. Resolved once
    # by the engine (EngineArgs) and shipped to every worker, so all ranks take the same graphs.
    prefill_graphs: bool = True
    piecewise_graphs: bool = True
    max_logprobs: int = 20                             # largest logprobs / prompt_logprobs; -1: no limit
    quantization: str | None = None                    # --quantization (quantization/config.py); None: as stored
    cpu_offload_gb: float = 0.0                        # CUDA: GiB of weights per GPU kept in CPU memory

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.compute_dtype_override or self.dtype

    @property
    def architecture(self) -> str:
        return (self.hf_config.get("architectures") or ["?"])[0]

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self.hf_config.get("head_dim") or self.hf_config["hidden_size"] // self.num_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")   # vLLM's names; fp8 is E4M3


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None   # bytes; CPU default is 4 GiB (as vLLM's CPU backend)
    num_gpu_blocks_override: int | None = None
    prefix_caching_hash_algo: str = "sha256"   # or "builtin": faster, not proof against crafted collisions
    cache_dtype: str = "auto"   # --kv-cache-dtype: auto (the model's compute dtype) or fp8 (E4M3, per-layer scales)

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.cache_dtype!r}: choose {', '.join(KV_CACHE_DTYPES)}"
                             + (" (E5M2 is not supported: fp8 is E4M3)" if self.cache_dtype == "fp8_e5m2" else ""))
        if self.prefix_caching_hash_algo not in ("sha256", "builtin"):
            raise ValueError(f"prefix_caching_hash_algo={self.prefix_caching_hash_algo!r}: choose sha256 or builtin")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two (e.g. 16)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory} must be a positive byte count")

    @property
    def fp8_kv(self) -> bool:
        return self.cache_dtype != "auto"


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout of one engine (TP x PP ranks) and how many engine replicas (DP)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False   # MoE experts split whole over TP (x DP) ranks, not sliced
    # Set by the data-parallel engine when experts span replicas: this replica's index and the
    # rendezvous all replicas' ranks join (distributed/parallel_state.init_groups).
    data_parallel_rank: int = 0
    data_parallel_master: str | None = None
    distributed_executor_backend: str | None = None   # None: uni for one device, else mp
    pp_layer_partition: tuple[int, ...] | None = None  # layers per pipeline stage
    distributed_timeout_s: float = 120.0               # rendezvous and collectives
    # Multi-node without Ray (torchrun's names): node 0 runs the engine, the others headless workers.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None   # torch.distributed rendezvous; workers dial the engine at port + 1
    # vLLM's --disable-custom-all-reduce: every TP all-reduce through NCCL, none one-shot over
    # symmetric memory or fused with the norm / matmul (distributed/comm.py)
    disable_custom_all_reduce: bool = False

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r}: "
                             "choose uni, mp or ray")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.world_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks cannot be "
                             f"spread evenly over nnodes={self.nnodes}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("a multi-node run needs master_port (and master_addr) like torchrun")
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ValueError("with Ray, nodes come from the Ray cluster: drop --nnodes/--node-rank")
        if self.experts_span_replicas and self.pipeline_parallel_size > 1:
            raise ValueError("expert parallelism across data-parallel replicas runs with pipeline_parallel_size=1; "
                             "use tensor parallelism inside each replica, or drop --data-parallel-size")
        if self.experts_span_replicas and (self.distributed_executor_backend == "ray" or self.nnodes > 1):
            raise ValueError("expert parallelism across data-parallel replicas runs on one node with the mp "
                             "executor")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError("the uni executor runs one device; use mp (or ray) for "
                             f"tensor_parallel_size x pipeline_parallel_size = {self.world_size}")

    @property
    def experts_span_replicas(self) -> bool:
        """Expert parallelism over DP x TP ranks: the replicas step together (engine/dp_engine.py)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def executor_backend(self) -> str:
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False     # schedule step N+1 while step N runs (engine.py)
    policy: str = "fcfs"               # or "priority": requests by (priority, arrival), engine/scheduler.py

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.policy!r}: choose {' or '.join(SCHEDULING_POLICIES)}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than max_model_len="
                f"{self.max_model_len}; enable chunked prefill or raise max_num_batched_tokens")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, with vLLM's keys: `{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b}` (drafts copied from earlier in the context) or
    `{"model": PATH, "num_speculative_tokens": k}` (a small draft model with the target's vocabulary)."""

    method: str                        # "ngram" or "draft_model"
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None           # the draft model's path (draft_model)
    draft_hf_config: dict[str, Any] | None = None   # its config.json, resolved by EngineArgs

    _KEYS = frozenset({"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"})

    @classmethod
    def from_user(cls, value: dict[str, Any] | str) -> SpeculativeConfig:
        """Parse the flag's JSON (or the dict LLM(speculative_config=...) takes); errors name the key."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(value) - cls._KEYS)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {unknown}; known: {sorted(cls._KEYS)}")
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method in ("ngram", "[ngram]"):
            method = "ngram"
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"--speculative-config: method {value.get('method')!r} is not supported; "
                             "use \"ngram\", or give \"model\" (a draft model's path)")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if method == "draft_model" and not value.get("model"):
            raise ValueError('--speculative-config: method "draft_model" needs "model" (the draft\'s path)')
        # vLLM's defaults: one bound given sets the other; neither gives 5 and 5.
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else (hi if hi is not None else 5)), (hi if hi is not None else (lo or 5))
        if method == "ngram" and not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo}, {hi}")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                   model=value.get("model"))


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    scheduler_config: SchedulerConfig
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    speculative_config: SpeculativeConfig | None = None
