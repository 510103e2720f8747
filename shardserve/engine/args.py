"""EngineArgs: every user-facing knob with vLLM's name, turned into a validated EngineConfig."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from shardserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_size,
    resolve_device,
    resolve_dtype,
)
from shardserve.layers.cpu_path import choose_cpu_path
from shardserve.models.loader import DEFAULT_MODEL_NAME, checkpoint_dtype, load_hf_config, resolve_model_path
from shardserve.models.registry import resolve_model_class
from shardserve.quantization.config import check_device, resolve_quantization
from shardserve.quantization.gguf import path_line as gguf_path_line

logger = logging.getLogger("shardserve")


def _compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """On CPUs the dtype activations are computed in is a choice (layers/cpu_path.py), logged once."""
    if device.type != "cpu":
        return dtype
    path = choose_cpu_path(dtype)
    logger.info("CPU path: %s", path.describe(dtype))
    return path.compute_dtype


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"   # or "priority" (config.SchedulerConfig)
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | str | None = None
    num_gpu_blocks_override: int | None = None
    prefix_caching_hash_algo: str = "sha256"
    kv_cache_dtype: str = "auto"   # or fp8 / fp8_e4m3: an E4M3 KV cache (half the bytes of bf16)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str | None = None
    pp_layer_partition: list[int] | None = None
    distributed_timeout_s: float = 120.0
    disable_custom_all_reduce: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    seed: int = 0
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    quantization: str | None = None
    enforce_eager: bool = False
    cpu_offload_gb: float = 0.0   # CUDA: GiB of each GPU's weights in pinned CPU memory (layers/cpu_offload.py)
    max_logprobs: int = 20
    async_scheduling: bool | None = None   # None: on for CUDA without pipeline stages
    speculative_config: dict | str | None = None   # vLLM's keys (config.SpeculativeConfig), or its JSON
    # Taken so vLLM's scripts and command lines run unchanged; nothing to trust: every architecture
    # is built in (models/registry.py) and no checkpoint code ever runs.
    trust_remote_code: bool = False

    def create_engine_config(self) -> EngineConfig:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r}: choose auto or dummy")
        if self.trust_remote_code:
            logger.info("trust_remote_code changes nothing here: every supported architecture is built in, "
                        "and no checkpoint code runs")
        path = resolve_model_path(self.model)
        hf_config = load_hf_config(path)
        resolve_model_class(hf_config)   # fail early, listing the supported architectures
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, checkpoint_dtype(hf_config), device)
        check_device(resolve_quantization(self.quantization, hf_config), device, dtype)
        self._check_cpu_offload(device)
        max_model_len = self._max_model_len(hf_config)
        name = self.served_model_name or (DEFAULT_MODEL_NAME if self.model is None
                                          else os.path.basename(os.path.normpath(self.model)))
        model_config = ModelConfig(model=path, served_model_name=name, hf_config=hf_config, dtype=dtype,
                                   max_model_len=max_model_len, seed=self.seed, tokenizer=self.tokenizer,
                                   skip_tokenizer_init=self.skip_tokenizer_init,
                                   compute_dtype_override=_compute_dtype(dtype, device),
                                   load_format=self.load_format, max_logprobs=self.max_logprobs,
                                   quantization=self.quantization,
                                   cpu_offload_gb=self.cpu_offload_gb,
                                   enforce_eager=(self.enforce_eager or self._experts_span_replicas
                                                  or self.cpu_offload_gb > 0),
                                   prefill_graphs=_graphs_switch("PREFILL"),
                                   piecewise_graphs=_graphs_switch("PIECEWISE"))
        if (hf_config.get("quantization_config") or {}).get("quant_method") == "gguf":
            # On the CPU beside the line _compute_dtype logged.
            logger.info("%s path: %s", "CPU" if device.type == "cpu" else "GPU", gguf_path_line(device))
        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size, enable_expert_parallel=self.enable_expert_parallel,
            distributed_executor_backend=self.distributed_executor_backend,
            pp_layer_partition=tuple(self.pp_layer_partition) if self.pp_layer_partition else None,
            distributed_timeout_s=self.distributed_timeout_s, nnodes=self.nnodes, node_rank=self.node_rank,
            master_addr=self.master_addr, master_port=self.master_port,
            disable_custom_all_reduce=self.disable_custom_all_reduce)
        check_parallel_layout(hf_config, parallel)
        speculative = self._speculative_config(hf_config)
        batched = self.max_num_batched_tokens or (2048 if self.enable_chunked_prefill else max_model_len)
        scheduler = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
                                    max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
                                    async_scheduling=self._async_scheduling(device, speculative),
                                    policy=self.scheduling_policy)
        kv_memory = parse_size(self.kv_cache_memory) if self.kv_cache_memory is not None else None
        cache = CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                            gpu_memory_utilization=self.gpu_memory_utilization, kv_cache_memory=kv_memory,
                            num_gpu_blocks_override=self.num_gpu_blocks_override,
                            prefix_caching_hash_algo=self.prefix_caching_hash_algo, cache_dtype=self.kv_cache_dtype)
        return EngineConfig(model_config, cache, parallel, scheduler, device, speculative)

    def _check_cpu_offload(self, device: torch.device) -> None:
        if self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb={self.cpu_offload_gb}: give the GiB of weights to keep in CPU "
                             "memory, 0 or more")
        if self.cpu_offload_gb > 0 and device.type != "cuda":
            raise ValueError(f"--cpu-offload-gb streams weights from CPU memory to a GPU; this run is on the "
                             f"{device.type}, where every weight is in CPU memory already: drop the flag")
        if self.cpu_offload_gb > 0:   # the streaming hooks are Python: steps run eagerly
            logger.info("CPU offload of %.2f GiB of weights per GPU: CUDA graphs off", self.cpu_offload_gb)

    def _speculative_config(self, hf_config: dict) -> SpeculativeConfig | None:
        """Parsed and checked against the target. Drafts follow a request's last token, so no
        pipeline stages (several steps in flight); a draft model runs after each step on its tokens,
        so no async scheduling with it (n-gram drafts hold back async steps only when they exist)."""
        if self.speculative_config is None:
            return None
        spec = SpeculativeConfig.from_user(self.speculative_config)
        if self.pipeline_parallel_size > 1 or self._experts_span_replicas:
            raise ValueError("speculative decoding does not run with pipeline parallelism or with experts "
                             "spanning data-parallel replicas; use tensor parallelism")
        if spec.method == "draft_model" and self.async_scheduling:
            raise ValueError("speculative decoding with a draft model needs async_scheduling off (the draft "
                             "catches up on each step's tokens before the next step)")
        if spec.method == "draft_model":
            draft_hf = load_hf_config(resolve_model_path(spec.model))
            resolve_model_class(draft_hf)
            if int(draft_hf["vocab_size"]) != int(hf_config["vocab_size"]):
                raise ValueError(f"the draft model's vocabulary ({draft_hf['vocab_size']} tokens) differs from the "
                                 f"target's ({hf_config['vocab_size']}): a draft must share the target's tokenizer")
            spec = replace(spec, model=resolve_model_path(spec.model), draft_hf_config=draft_hf)
        return spec

    @property
    def _experts_span_replicas(self) -> bool:
        """Replicas step together and exchange tokens of data-dependent sizes in every MoE layer:
        no CUDA graphs, no second step in flight (engine/dp_engine.py)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    def _async_scheduling(self, device, speculative: SpeculativeConfig | None) -> bool:
        if speculative is not None and speculative.method == "draft_model":   # checked in _speculative_config
            return False
        if self._experts_span_replicas:
            if self.async_scheduling:
                raise ValueError("async_scheduling does not run with expert parallelism across data-parallel "
                                 "replicas (the replicas step together)")
            return False
        if self.async_scheduling is None:   # a CPU computes in the caller's thread: nothing to overlap
            return device.type == "cuda" and self.pipeline_parallel_size == 1
        if self.async_scheduling and self.pipeline_parallel_size > 1:
            raise ValueError("async_scheduling needs pipeline_parallel_size=1 (pipeline stages already keep "
                             "several steps in flight)")
        return self.async_scheduling

    def _max_model_len(self, hf_config: dict) -> int:
        limit = int(hf_config.get("max_position_embeddings") or 2048)
        if self.max_model_len is None:
            return limit
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{limit}; use at most {limit}")
        return self.max_model_len


def _num_experts(hf_config: dict) -> int:
    return int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)


def valid_tp_sizes(hf_config: dict, expert_parallel: bool = False) -> list[int]:
    """TP sizes the model's shapes allow: they divide the attention heads and the MLP width, and
    KV heads either split evenly or are replicated evenly. For a MoE model they also divide each
    expert's width (experts sliced over TP) or, with expert parallelism, the number of experts."""
    heads = int(hf_config["num_attention_heads"])
    kv = int(hf_config.get("num_key_value_heads") or heads)
    widths = [int(hf_config["intermediate_size"])]
    if _num_experts(hf_config):
        widths.append(_num_experts(hf_config) if expert_parallel
                      else int(hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"]))
    return [t for t in range(1, heads + 1)
            if heads % t == 0 and all(w % t == 0 for w in widths) and (kv % t == 0 or t % kv == 0)]


def check_parallel_layout(hf_config: dict, parallel: ParallelConfig) -> None:
    from shardserve.distributed.parallel_state import pp_layer_partition
    tp, ep = parallel.tensor_parallel_size, parallel.enable_expert_parallel
    if ep and not _num_experts(hf_config):
        raise ValueError("enable_expert_parallel needs a mixture-of-experts model; "
                         f"{(hf_config.get('architectures') or ['this model'])[0]} has no experts")
    valid = valid_tp_sizes(hf_config, ep)
    if tp not in valid:
        experts = ""
        if _num_experts(hf_config):
            experts = (f", {_num_experts(hf_config)} experts split whole over the expert-parallel ranks" if ep else
                       f", expert width {hf_config.get('moe_intermediate_size') or hf_config['intermediate_size']}")
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide this model's {hf_config['num_attention_heads']} attention "
            f"heads ({hf_config.get('num_key_value_heads')} KV heads, intermediate size "
            f"{hf_config['intermediate_size']}{experts}); sizes that work: {', '.join(map(str, valid))}")
    pp_layer_partition(int(hf_config["num_hidden_layers"]), parallel.pipeline_parallel_size,
                       parallel.pp_layer_partition)


def _graphs_switch(kind: str) -> bool:
    """SHARDSERVE_{kind}_GRAPHS (prefill, piecewise): 1 on, 0/false/off/no off (A/B runs). Unset: on,
    with TP too (their two-GPU test, tests/gpu/test_cuda_parallel.py, passes on 2x H100)."""
    value = os.environ.get(f"SHARDSERVE_{kind}_GRAPHS")
    if value is None:
        return True
    return value.strip().lower() not in ("0", "false", "off", "no", "")
