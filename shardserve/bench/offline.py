"""`shardserve bench throughput` and `shardserve bench latency` (like vLLM's), each printed beside the
physical limits measured in the same run:

- decode roofline: one decode step must read every weight byte of a rank plus the KV cache it
  attends over, so step time >= (weights + KV bytes) / memory bandwidth, the bandwidth measured
  with a large device-to-device copy (bytes read + written per second). For a MoE model the step
  reads only the routed experts its tokens picked (bench/shapes.picked_expert_fraction);
- throughput roofline: no schedule runs a batch of requests faster than its longest output's steps
  each reading every weight byte once, plus each decode token reading its request's KV cache once,
  at the measured bandwidth, nor faster than its model FLOPs at the measured peak; the larger of the
  two is the bound, and the MFU a run at that bound would show is printed beside the run's;
- model FLOPs utilisation: 2 x (non-embedding parameters) FLOPs per token processed, divided by the
  time, against the peak of one large matmul in the serving dtype, timed in the same run. For a
  MoE model the parameters are the active ones (top-k experts per token).

With `--random-weights SHAPE` (llama-3-8b, llama-3-70b, qwen3-0.6b, qwen3-8b, or a config.json /
checkpoint directory) the model is built full size with random weights: no hub, no tokenizer.
`-q fp8` quantizes them at load; `-q gptq` / `-q awq` make the model an INT4 checkpoint of that
format instead (group 128, random 4-bit values and zeros, scales 1), as a real one would load, and
`-q fp8-block` an FP8 checkpoint with 128 x 128 block scales (Qwen3-*-FP8's format). The
roofline counts the bytes each format holds per weight (FP8 1, INT4 1/2 plus its group's scale and
zero).
"""
from __future__ import annotations

import json
import os
import random
import time
from typing import Any

import numpy as np
import torch

from shardserve.bench.shapes import (
    active_layer_params,
    param_counts,
    picked_expert_fraction,
    shape_config,
    write_shape_dir,
)
from shardserve.quantization.stored import head_quantized, modelopt_fields, weight_dtype
from shardserve.worker.profiler import require_profiler_dir


def model_source(ns) -> tuple[str, dict[str, Any], bool]:
    """(checkpoint path, HF config, random weights?)"""
    if ns.random_weights:
        spec = ns.random_weights
        if os.path.isdir(spec) or spec.endswith(".json"):
            with open(os.path.join(spec, "config.json") if os.path.isdir(spec) else spec) as f:
                config = json.load(f)
            name = os.path.basename(spec.rstrip("/"))
        else:
            config, name = shape_config(spec), spec
        if getattr(ns, "quantization", None) in RANDOM_FORMATS:   # the shape as a GPTQ / AWQ / block-FP8 checkpoint
            config = {**config, "quantization_config": RANDOM_FORMATS[ns.quantization]}
        return write_shape_dir(config, name), config, True
    if getattr(ns, "quantization", None) in RANDOM_FORMATS:
        raise ValueError(f"-q {ns.quantization} makes random weights of that format (with --random-weights); a "
                         "quantized checkpoint is read in its own format without the flag")
    from shardserve.models.loader import load_hf_config, resolve_model_path
    path = resolve_model_path(ns.model)
    return path, load_hf_config(path), False


INT4_GROUP = 128
RANDOM_FORMATS = {   # the quantization_config a random-weight checkpoint of the format carries, as the tools write it
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": INT4_GROUP, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": INT4_GROUP, "zero_point": True, "version": "gemm"},
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",   # Qwen3-*-FP8's
                  "weight_block_size": [128, 128]},
}


def make_llm(ns, path: str, random_weights: bool):
    from shardserve import LLM
    quantization = getattr(ns, "quantization", None)
    kw = dict(dtype=ns.dtype, device=ns.device, max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
              max_num_batched_tokens=ns.max_num_batched_tokens, seed=ns.seed,
              tensor_parallel_size=ns.tensor_parallel_size, gpu_memory_utilization=ns.gpu_memory_utilization,
              enable_expert_parallel=getattr(ns, "enable_expert_parallel", False),
              quantization=None if quantization in RANDOM_FORMATS else quantization,   # in the config
              enforce_eager=ns.enforce_eager, async_scheduling=ns.async_scheduling,
              cpu_offload_gb=getattr(ns, "cpu_offload_gb", 0.0), kv_cache_dtype=getattr(ns, "kv_cache_dtype", "auto"),
              enable_prefix_caching=ns.enable_prefix_caching)
    if ns.kv_cache_memory:
        kw["kv_cache_memory"] = ns.kv_cache_memory
    if random_weights:
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    return LLM(path, **kw)


def measure_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large copy (read + write), the memory roofline's denominator."""
    n = (2 if device.type == "cuda" else 0.25) * 1024**3
    x = torch.empty(int(n), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / _seconds(lambda: y.copy_(x), device, 3, 10)


def measure_host_to_device(device: torch.device) -> float:
    """Bytes per second of a 1 GiB copy from pinned CPU memory to the GPU (the PCIe link)."""
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    x = torch.empty_like(host, device=device)
    return host.numel() / _seconds(lambda: x.copy_(host, non_blocking=True), device, 2, 5)


def measure_matmul_peak(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of one large square matmul in the compute dtype."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _seconds(lambda: a @ b, device, 2, 5 if device.type == "cpu" else 20)


def _seconds(fn, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / iters


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes_per_token(config: dict[str, Any], elem: int) -> int:
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hd = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv * hd * elem


def model_flops(counts: dict[str, int], tokens_in: int, tokens_out: int) -> float:
    """2 FLOPs per weight per token through the layers; the LM head (the embedding matrix when tied)
    only for the tokens whose logits are computed, one per output token."""
    head = counts["lm_head"] or counts["embed"]
    return 2.0 * active_layer_params(counts) * (tokens_in + tokens_out) + 2.0 * head * tokens_out


def throughput_bound_s(lim: dict[str, Any], config: dict[str, Any], kv_elem: int, prompt_lens: list[int],
                       output_lens: list[int]) -> tuple[float, float]:
    """(seconds, of which the memory bound) below which no schedule runs these requests on one rank:
    the steps are at least the longest output (one token per request a step), each reads every
    weight byte (of a MoE model: one token's experts at least), and each decode token reads the KV
    of its request's context once; the model FLOPs take their time at the peak. The larger bound
    holds (memory and compute may overlap), so it is a bound, not a forecast."""
    read = lim["dense_bytes_per_rank"] + lim["expert_bytes_per_rank"] * picked_expert_fraction(config, 1)
    kv_tokens = sum((n - 1) * p + (n - 1) * n // 2 for p, n in zip(prompt_lens, output_lens))
    memory = (max(output_lens) * read + kv_tokens * kv_bytes_per_token(config, kv_elem) / lim["tp"]) / lim["bandwidth"]
    compute = model_flops(lim["counts"], sum(prompt_lens), sum(output_lens)) / lim["tp"] / lim["peak_flops"]
    return max(memory, compute), memory


def random_prompts(n: int, input_len: int, ratio: float, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = max(1, int(input_len * (1 - ratio))), max(1, int(input_len * (1 + ratio)))
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def throughput_requests(ns, vocab: int) -> tuple[list[list[int]], list[Any]]:
    """`bench throughput`'s requests: random prompts and greedy, EOS-ignoring params whose output
    lengths are drawn like the prompts' (also benchmarks/throughput_steps.py's)."""
    from shardserve import SamplingParams
    prompts = random_prompts(ns.num_prompts, ns.input_len, ns.random_range_ratio, vocab, ns.seed)
    rng = random.Random(ns.seed + 1)
    lo = max(1, int(ns.output_len * (1 - ns.random_range_ratio)))
    hi = max(1, int(ns.output_len * (1 + ns.random_range_ratio)))
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(lo, hi), ignore_eos=True, detokenize=False)
              for _ in prompts]
    return prompts, params


def _limits(llm, config: dict[str, Any]) -> dict[str, Any]:
    model_config = llm.engine.config.model_config
    device = llm.engine.config.device
    tp = llm.engine.config.parallel_config.tensor_parallel_size
    elem = torch.tensor([], dtype=model_config.dtype).element_size()
    counts = param_counts(config)
    # FP8 layers hold one byte per weight, INT4 ones half a byte and a scale and zero per group (the
    # layout the GPU kernels read); embeddings, LM head (unless quantized), norms and experts stay in the dtype.
    linear_elem, label = _linear_bytes(model_config.quantization, config, elem)
    head = head_quantized(config.get("quantization_config"))   # GPTQ's lm_head: true, compressed-tensors' ignore
    in_dtype = counts["embed"] + (0 if head else counts["lm_head"]) + counts["experts"]
    if linear_elem is None:   # what the ranks hold as loaded (GGUF: blocks kept, parts dequantized)
        total = tp * max(llm.engine.executor.collective_rpc("weight_bytes"))
        experts = tp * max(llm.engine.executor.collective_rpc("weight_bytes", (True,)))
    else:
        total = (counts["total"] - in_dtype) * linear_elem + in_dtype * elem
        experts = counts["experts"] * elem
    return {"device": device, "tp": tp, "elem": elem, "counts": counts,
            "weight_bytes_per_rank": total / tp,
            "dense_bytes_per_rank": (total - experts) / tp, "expert_bytes_per_rank": experts / tp,
            "bandwidth": measure_bandwidth(device),
            "peak_flops": measure_matmul_peak(device, model_config.compute_dtype),
            "dtype": str(model_config.dtype).replace("torch.", "") + label}


def _fp4_held() -> str:
    from shardserve.quantization.stored import fp4_kept_on_gpus
    return "4-bit on CUDA, dequantized on the CPU" if fp4_kept_on_gpus() else "dequantized at load"


def _linear_bytes(requested: str | None, config: dict[str, Any], elem: int) -> tuple[float | None, str]:
    """Bytes per weight of the quantized linear layers (None: counted as held, for GGUF blocks and
    layers in several schemes), and a label for the dtype line."""
    stored = (config.get("quantization_config") or {}).get("quant_method")
    if stored == "gguf":
        return None, " GGUF weights (bytes as held)"
    algo = str(modelopt_fields(config["quantization_config"]).get("quant_algo")).upper() if stored == "modelopt" else ""
    if algo == "MIXED_PRECISION":
        return None, " weights in several schemes (modelopt MIXED_PRECISION; bytes as held)"
    if stored == "modelopt" and weight_dtype(config["quantization_config"]) != "fp8":   # NVFP4 (quantization/fp4.py)
        return None, f" nvfp4 weights (modelopt; {_fp4_held()}: bytes as held)"
    # (block-scaled FP8: a scale per 128 x 128 weights, ~0.02%)
    if (requested or stored) in ("fp8", "fbgemm_fp8", "modelopt"):
        block = (config.get("quantization_config") or {}).get("weight_block_size")
        return 1.0, f" fp8 weights (blocks of {block[0]} x {block[1]})" if block else " fp8 weights"
    if stored in ("gptq", "awq"):
        from shardserve.quantization.int4 import held_bytes_per_weight
        cfg = config["quantization_config"]
        if cfg.get("dynamic"):   # GPTQModel's per-module overrides: layers in several schemes
            return None, f" weights in several schemes ({stored} dynamic; bytes as held)"
        if cfg.get("bits", cfg.get("w_bit", 4)) != 4:   # 8-bit GPTQ: dequantized at load (quantization/int4.py)
            return float(elem), f" {cfg.get('bits')}-bit {stored} weights dequantized at load"
        group = cfg.get("group_size", cfg.get("q_group_size", 128))
        return held_bytes_per_weight(group, config["hidden_size"]), f" int4 weights ({stored}, group {group})"
    if stored == "compressed-tensors":
        from shardserve.quantization.ct_scheme import parse, sparsity_only
        from shardserve.quantization.int4 import held_bytes_per_weight
        if sparsity_only(config["quantization_config"]):   # pruned, stored dense, full precision
            return float(elem), ""
        layout = parse(config["quantization_config"])
        if [target for target, _ in layout.targets] != ["Linear"]:   # layers in several schemes or left out
            return None, " weights in several schemes (compressed-tensors; bytes as held)"
        scheme = layout.default
        if scheme.weights == "fp8":
            return 1.0, f" fp8 weights (compressed-tensors, {scheme.strategy} scales)"
        if scheme.weights in ("nvfp4", "mxfp4"):   # quantization/fp4.py
            return None, f" {scheme.weights} weights (compressed-tensors; {_fp4_held()}: bytes as held)"
        if scheme.weights == "int8":   # kept INT8 on GPUs only in some layouts (quantization/int8.py)
            if weight_dtype(config["quantization_config"]) == "int8":
                return 1.0, f" int8 weights (compressed-tensors, {scheme.strategy} scales)"
            return float(elem), " int8 weights widened at load (compressed-tensors)"
        group = scheme.group_size or -1
        return held_bytes_per_weight(group, config["hidden_size"]), f" int4 weights (compressed-tensors, group {group})"
    return float(elem), ""


def run_latency(ns) -> dict[str, Any]:
    from shardserve import SamplingParams
    if ns.profile:   # fail before loading the model, not after timing it
        require_profiler_dir()
    path, config, random_weights = model_source(ns)
    llm = make_llm(ns, path, random_weights)
    traces: list[str] = []
    try:
        lim = _limits(llm, config)
        offloaded = max(llm.engine.executor.collective_rpc("cpu_offload_bytes"))
        prompts = random_prompts(ns.batch_size, ns.input_len, 0.0, config["vocab_size"], ns.seed)

        def once(max_tokens: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - t

        from tqdm.auto import tqdm
        for _ in tqdm(range(ns.num_iters_warmup), desc="Warm-up"):
            once(ns.output_len)
        e2e = [once(ns.output_len) for _ in tqdm(range(ns.num_iters), desc="Profiling")]
        # At least five one-token runs (each one prefill): with fewer, one slow prefill moved the decode
        # step figure derived from it by 0.1 ms at batch 1 (BENCHMARKS.md, session 31).
        prefill = float(np.median([once(1) for _ in range(max(5, ns.num_iters))]))
        if ns.profile:   # one more batch under the profiler, after (and outside) the timed ones
            llm.start_profile()
            once(ns.output_len)
            traces = llm.stop_profile()
    finally:
        llm.engine.shutdown()
    # With one output token there is no decode step to time: the run measures prefill alone (TTFT).
    step = (float(np.median(e2e)) - prefill) / (ns.output_len - 1) if ns.output_len > 1 else float("nan")
    context = ns.input_len + ns.output_len / 2   # average tokens attended over during decode
    kv = ns.batch_size * context * kv_bytes_per_token(config, lim["elem"]) / lim["tp"]
    picked = lim["expert_bytes_per_rank"] * picked_expert_fraction(config, ns.batch_size)
    read = lim["dense_bytes_per_rank"] + picked   # every weight byte of a dense model
    roofline = (read + kv) / lim["bandwidth"]
    flops = model_flops(lim["counts"], ns.batch_size * ns.input_len, ns.batch_size * ns.output_len)
    result = {"batch_size": ns.batch_size, "input_len": ns.input_len, "output_len": ns.output_len,
              "avg_latency_s": float(np.mean(e2e)),
              **{f"p{p}_latency_s": float(np.percentile(e2e, p)) for p in (10, 25, 50, 75, 90, 99)},
              "prefill_s": prefill, "decode_step_ms": step * 1000, "roofline_step_ms": roofline * 1000,
              "step_vs_roofline": step / roofline, "bandwidth_gb_s": lim["bandwidth"] / 1e9,
              "weight_gb_per_rank": lim["weight_bytes_per_rank"] / 1e9, "weight_gb_read_per_step": read / 1e9,
              "mfu": flops / lim["tp"] / float(np.median(e2e)) / lim["peak_flops"],
              "peak_tflops": lim["peak_flops"] / 1e12, "dtype": lim["dtype"], "device": str(lim["device"]),
              **({"profile_traces": traces} if ns.profile else {})}
    if offloaded:   # every step copies the offloaded layers in: it cannot beat that copy
        h2d = measure_host_to_device(lim["device"])
        result.update(offloaded_gb_per_rank=offloaded / 1e9, host_to_device_gb_s=h2d / 1e9,
                      offload_bound_step_ms=1000 * offloaded / h2d)
    print(f"Avg latency: {result['avg_latency_s']:.4f} seconds")
    for p in (10, 25, 50, 75, 90, 99):
        print(f"{p}% percentile latency: {result[f'p{p}_latency_s']:.4f} seconds")
    print(f"Prefill (time to first token): {1000 * prefill:.2f} ms")
    if ns.output_len > 1:
        print(f"Decode step: {result['decode_step_ms']:.2f} ms; roofline {result['roofline_step_ms']:.2f} ms "
              f"({result['weight_gb_read_per_step']:.2f} GB weights + KV per rank at "
              f"{result['bandwidth_gb_s']:.0f} GB/s "
              f"measured): {result['step_vs_roofline']:.2f}x the roofline")
    print(f"Model FLOPs utilisation: {100 * result['mfu']:.2f}% of {result['peak_tflops']:.1f} TFLOP/s "
          f"({lim['dtype']} matmul measured in this run)")
    if offloaded:
        print(f"CPU offload: {offloaded / 1e9:.2f} GB per rank streamed each step; at {h2d / 1e9:.1f} GB/s "
              f"host-to-device (measured) no step can take less than {result['offload_bound_step_ms']:.2f} ms "
              f"(the decode step is {result['decode_step_ms'] / result['offload_bound_step_ms']:.2f}x that bound)")
    for trace in traces:
        print(f"profile trace: {trace}")
    return result


def run_throughput(ns) -> dict[str, Any]:
    from shardserve import SamplingParams
    if ns.profile:
        require_profiler_dir()
    path, config, random_weights = model_source(ns)
    llm = make_llm(ns, path, random_weights)
    traces: list[str] = []
    try:
        lim = _limits(llm, config)
        prompts, params = throughput_requests(ns, config["vocab_size"])
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)   # warm-up
        if ns.profile:   # as vLLM does: the timed run itself, so its figures include the profiler's cost
            llm.start_profile()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - t
        if ns.profile:
            traces = llm.stop_profile()
    finally:
        llm.engine.shutdown()
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    flops = model_flops(lim["counts"], n_in, n_out)
    kv_elem = 1 if llm.engine.config.cache_config.cache_dtype.startswith("fp8") else lim["elem"]
    bound, memory_bound = throughput_bound_s(lim, config, kv_elem, [len(p) for p in prompts],
                                             [len(o.outputs[0].token_ids) for o in outs])
    result = {"elapsed_time": elapsed, "num_requests": len(prompts), "total_num_tokens": n_in + n_out,
              "requests_per_second": len(prompts) / elapsed, "tokens_per_second": (n_in + n_out) / elapsed,
              "output_tokens_per_second": n_out / elapsed,
              "mfu": flops / lim["tp"] / elapsed / lim["peak_flops"],
              "roofline_s": bound, "roofline_memory_s": memory_bound, "run_vs_roofline": elapsed / bound,
              "roofline_mfu": flops / lim["tp"] / bound / lim["peak_flops"],
              "peak_tflops": lim["peak_flops"] / 1e12, "bandwidth_gb_s": lim["bandwidth"] / 1e9,
              "dtype": lim["dtype"], "device": str(lim["device"]), **({"profile_traces": traces} if ns.profile else {})}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
          f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Model FLOPs utilisation: {100 * result['mfu']:.2f}% of {result['peak_tflops']:.1f} TFLOP/s "
          f"({lim['dtype']} matmul measured in this run); memory bandwidth {result['bandwidth_gb_s']:.0f} GB/s")
    print(f"Roofline: no schedule runs these requests in less than {bound:.2f} s here ("
          f"{'memory' if memory_bound >= bound else 'FLOPs'}-bound: weights read once a step for "
          f"{max(len(o.outputs[0].token_ids) for o in outs)} steps, each decode token's KV once); the run took "
          f"{result['run_vs_roofline']:.2f}x that; MFU at the bound: {100 * result['roofline_mfu']:.1f}%")
    for trace in traces:
        print(f"profile trace: {trace} (the figures above include the profiler's cost)")
    return result
