"""How many KV blocks a worker's pool gets: its bytes per block, and the budget (a fixed number of
blocks, `kv_cache_memory`, the CPU default, or what profiling the largest step leaves of
`gpu_memory_utilization` on a GPU). And the pool's dtype where the user picks it: `--kv-cache-dtype
fp8` is E4M3, one byte per value (kernels/attention/kv_fp8.py), checked against the device and
backend at start-up."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from shardserve.kernels.attention.kv_fp8 import FP8_KV
from shardserve.utils import cdiv
from shardserve.worker.startup_steps import profile_step

if TYPE_CHECKING:
    from shardserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3   # vLLM's CPU backend default (VLLM_CPU_KVCACHE_SPACE=4)
GRAPH_MEMORY_RESERVE = 2 * 1024**3         # kept out of the KV pool for CUDA-graph capture


def check_fp8_kv_cache(runner: "ModelRunner") -> None:
    """At start-up, once the backend is chosen: refuse an fp8 pool where it cannot run, and say
    which scales it uses (vLLM's warning when a checkpoint gives none)."""
    from shardserve.layers.attention.cuda_backend import CudaAttentionBackend
    if runner.kv_cache_dtype != FP8_KV:
        return
    if isinstance(runner.backend, CudaAttentionBackend):
        major, minor = torch.cuda.get_device_capability(runner.device)
        if (major, minor) < (8, 9):
            raise ValueError(f"--kv-cache-dtype fp8 needs FP8 support in the GPU (compute capability 8.9 or "
                             f"newer: Ada, Hopper, Blackwell); {torch.cuda.get_device_name(runner.device)} is "
                             f"{major}.{minor}. Use --kv-cache-dtype auto")
    layers = runner.model.attention_layers()
    loaded = sum(len(layer.scales_loaded) == 2 for layer in layers)
    if loaded:
        logger.info("fp8 (E4M3) KV cache: the checkpoint's k_scale / v_scale in %d of %d layers%s", loaded,
                    len(layers), "" if loaded == len(layers) else ", 1.0 in the others")
    else:
        logger.warning("fp8 (E4M3) KV cache with k_scale = v_scale = 1.0: the checkpoint gives no KV-cache "
                       "scales, which may cost accuracy where keys or values exceed +-448 or fall below ~0.002")


def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    layers = model.attention_layers()
    spec = layers[0].spec
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * len(layers) * block_size * spec.num_kv_heads * spec.head_dim * element


def determine_num_blocks(runner: "ModelRunner") -> int:
    cache_config = runner.config.cache_config
    if cache_config.num_gpu_blocks_override:
        return cache_config.num_gpu_blocks_override
    if runner.device.type == "cuda" and cache_config.kv_cache_memory is None:
        budget = profile_cuda_kv_budget(runner)
    else:
        budget = cache_config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
    return budget // runner.kv_bytes_per_block()


def profile_cuda_kv_budget(runner: "ModelRunner") -> int:
    """Run the largest step the scheduler may issue, then give the KV pool what is left of
    gpu_memory_utilization x total memory. As in vLLM, that share is this instance's own: other
    processes on the GPU do not count against it, only against what is really free."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    scheduler_config = runner.config.scheduler_config
    tokens, max_len = scheduler_config.max_num_batched_tokens, scheduler_config.max_model_len
    blocks_per_request = cdiv(min(tokens, max_len), runner.block_size)
    runner.initialize_kv_cache(blocks_per_request * max(1, cdiv(tokens, max_len)) + 1, capture_graphs=False)
    profile_step(runner, tokens, max_len, scheduler_config.max_num_seqs)
    torch.cuda.synchronize(runner.device)
    runner.release_kv_cache()
    torch.cuda.empty_cache()
    peak = torch.cuda.max_memory_allocated(runner.device)
    free, total = torch.cuda.mem_get_info(runner.device)
    # Memory outside torch's allocator that loading and the step added (cuBLAS/NCCL workspaces).
    own_non_torch = max(total - free - torch.cuda.memory_reserved(runner.device) - runner.cuda_baseline, 0)
    utilization = runner.config.cache_config.gpu_memory_utilization
    share = int(total * utilization) - peak - own_non_torch
    # Steps take their activations back up to the peak beside the pool.
    really_free = free - (peak - torch.cuda.memory_allocated(runner.device))
    if really_free < share:
        logger.warning("other processes hold %.1f GiB of %s: the KV cache gets the %.1f GiB really free, not "
                       "the %.1f GiB gpu_memory_utilization=%s leaves", runner.cuda_baseline / 2**30, runner.device,
                       max(really_free, 0) / 2**30, share / 2**30, utilization)
    budget = min(share, really_free)
    if runner.wants_graphs():   # decode graphs are captured after the pool is allocated
        budget -= GRAPH_MEMORY_RESERVE
    if budget <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache on {runner.device}: weights and activations peak at "
            f"{peak / 2**30:.1f} GiB, {max(really_free, 0) / 2**30:.1f} GiB is free beside them, of "
            f"{total / 2**30:.1f} GiB x gpu_memory_utilization={utilization}; raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, free the GPU, or shard the model")
    return budget
