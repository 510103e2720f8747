"""The engine's command-line flags, spelled as vLLM spells them, and the EngineArgs they make: shared
by `serve`, `chat`, `generate` and the headless `worker` (shardserve/cli.py builds the commands)."""
from __future__ import annotations

import argparse
import os

from shardserve.config import KV_CACHE_DTYPES, SCHEDULING_POLICIES
from shardserve.engine.args import EngineArgs
from shardserve.quantization.config import CHECKPOINT_FORMATS, QUANTIZATION_METHODS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, spelled as vLLM spells them."""
    d = EngineArgs()
    parser.add_argument("--model", default=None, help="HF checkpoint directory or .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's own)")
    parser.add_argument("--dtype", default=d.dtype, help="auto, bfloat16, float16 or float32 (default: %(default)s)")
    parser.add_argument("--device", default=d.device, help="auto, cpu or cuda (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="default: %(default)s")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget per step (default: 2048; the model length without chunked prefill)")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="split long prompts over steps, beside running decodes (default: on)")
    parser.add_argument("--scheduling-policy", choices=list(SCHEDULING_POLICIES), default=d.scheduling_policy,
                        help="fcfs: requests in arrival order; priority: by each request's priority (lower "
                        "first), then arrival, and under KV pressure the lowest-priority request is preempted "
                        "first (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=d.block_size,
                        help="KV block size in tokens (default: %(default)s)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse KV blocks of shared prefixes (default: on)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help="fraction of GPU memory to use (default: %(default)s)")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV cache budget in bytes, e.g. 4GiB (CPU default: 4GiB)")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=d.kv_cache_dtype,
                        help="auto: the model's compute dtype; fp8 (= fp8_e4m3): E4M3 with per-layer k/v scales "
                        "(the checkpoint's, else 1.0), half the bytes of bf16 (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, help="default: %(default)s")
    parser.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                        help="largest logprobs a request may ask for; -1: no limit (default: %(default)s)")
    parser.add_argument("--cpu-offload-gb", type=float, default=d.cpu_offload_gb,
                        help="CUDA: GiB of each GPU's weights kept in pinned CPU memory and streamed in for every "
                        "step (whole decoder layers; CUDA graphs off), so a model larger than the GPU serves "
                        "(default: %(default)s)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs (default: off)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule and prepare step N+1 while step N runs on the device "
                             "(default: on for CUDA without pipeline parallelism)")
    parser.add_argument("--quantization", "-q", choices=sorted({*QUANTIZATION_METHODS, *CHECKPOINT_FORMATS}),
                        default=None, help="fp8: quantize a full-precision checkpoint's weights at load; a quantized "
                        "checkpoint's own format is read from its config (naming it here only checks it; "
                        "default: none)")
    parser.add_argument("--speculative-config", default=None,
                        help='speculative decoding, JSON with vLLM\'s keys: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4} or {"model": DRAFT_PATH, '
                        '"num_speculative_tokens": 4} (default: off)')
    parser.add_argument("--trust-remote-code", action="store_true", help="accepted for vLLM's command lines; "
                        "changes nothing: every supported architecture is built in and no checkpoint code runs "
                        "(default: off)")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights with the checkpoint's shapes, for benchmarks "
                        "(default: %(default)s)")
    add_parallel_args(parser)


def add_parallel_args(parser: argparse.ArgumentParser, engine: bool = True) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks per layer (default: 1)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages (default: 1)")
    if engine:
        g.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="engine replicas (default: 1)")
        g.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                       help="MoE models: split whole experts over the TP (x DP) ranks instead of slicing every "
                       "expert (default: off)")
        g.add_argument("--distributed-executor-backend", choices=["uni", "mp", "ray"], default=None,
                       help="uni for one device, mp (default for more) or ray")
        g.add_argument("--pp-layer-partition", default=None,
                       help="layers per pipeline stage, comma-separated, e.g. 17,15 (default: even)")
        g.add_argument("--disable-custom-all-reduce", action="store_true",
                       help="CUDA: every TP all-reduce through NCCL, none one-shot over symmetric memory or fused "
                       "with the next norm or the matmul before it (default: off)")
    # Inside a LeaderWorkerSet the group's env gives the defaults (docs/deploy.md); flags still win.
    env = os.environ
    g.add_argument("--nnodes", type=int, default=int(env.get("LWS_GROUP_SIZE", 1)),
                   help="nodes in a multi-node run (default: $LWS_GROUP_SIZE, else 1)")
    g.add_argument("--node-rank", type=int, default=int(env.get("LWS_WORKER_INDEX", 0)),
                   help="this node's index; 0 runs the engine (default: $LWS_WORKER_INDEX, else 0)")
    g.add_argument("--master-addr", default=env.get("LWS_LEADER_ADDRESS", "127.0.0.1"),
                   help="node 0's address (default: $LWS_LEADER_ADDRESS, else 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=None, help="rendezvous port on node 0; its workers "
                   "listen on port + 1 (default: none; required with --nnodes > 1)")
    g.add_argument("--distributed-timeout-s", type=float, default=120.0,
                   help="how long ranks wait for each other (start-up rendezvous, collectives) and a headless "
                   "node for the engine, in seconds (default: %(default)s)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(model=ns.model, tokenizer=ns.tokenizer, dtype=ns.dtype, device=ns.device,
                      max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
                      max_num_batched_tokens=ns.max_num_batched_tokens, block_size=ns.block_size,
                      enable_chunked_prefill=ns.enable_chunked_prefill, enable_prefix_caching=ns.enable_prefix_caching,
                      scheduling_policy=ns.scheduling_policy,
                      gpu_memory_utilization=ns.gpu_memory_utilization, kv_cache_memory=ns.kv_cache_memory,
                      kv_cache_dtype=ns.kv_cache_dtype,
                      seed=ns.seed, max_logprobs=ns.max_logprobs, load_format=ns.load_format,
                      quantization=ns.quantization,
                      enforce_eager=ns.enforce_eager, async_scheduling=ns.async_scheduling,
                      cpu_offload_gb=ns.cpu_offload_gb,
                      speculative_config=ns.speculative_config,
                      tensor_parallel_size=ns.tensor_parallel_size,
                      pipeline_parallel_size=ns.pipeline_parallel_size, data_parallel_size=ns.data_parallel_size,
                      enable_expert_parallel=ns.enable_expert_parallel,
                      distributed_executor_backend=ns.distributed_executor_backend,
                      pp_layer_partition=[int(x) for x in ns.pp_layer_partition.split(",")]
                      if ns.pp_layer_partition else None,
                      nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
                      master_port=ns.master_port, distributed_timeout_s=ns.distributed_timeout_s,
                      disable_custom_all_reduce=ns.disable_custom_all_reduce, trust_remote_code=ns.trust_remote_code)
