"""Issue 6's G1 in one run: single-stream (or batched) decode of a random-weight model with real
shapes, ours beside HF transformers' generate() and beside the measured roofline.

    python3 benchmarks/decode_vs_hf.py --shape llama-3-8b --batch-size 1 --json out.json

Ours: `shardserve bench latency` (CUDA graphs on). HF: the same config with random weights, bf16,
greedy generate() of the same lengths, in a second process once ours has exited the GPU. Both
figures are end-to-end tokens/s (prompt included).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve.bench.offline import run_latency  # noqa: E402
from shardserve.bench.report import report  # noqa: E402
from shardserve.bench.shapes import shape_config  # noqa: E402


def hf_tokens_per_s(config: dict, batch: int, input_len: int, output_len: int, iters: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = dict(config)
    cfg_obj = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg_obj, dtype=torch.bfloat16).eval()
    ids = torch.randint(100, config["vocab_size"] - 100, (batch, input_len), device="cuda")
    gen = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})
        times = []
        for _ in range(iters):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, **gen)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return batch * output_len / sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)   # the HF half, in its own process
    a = p.parse_args()
    if a.hf_only:
        print(json.dumps({"hf_tokens_per_s": hf_tokens_per_s(shape_config(a.shape), a.batch_size, a.input_len,
                                                              a.output_len, a.iters)}))
        return
    ns = argparse.Namespace(random_weights=a.shape, model=None, dtype="bfloat16", device="cuda", max_model_len=None,
                            max_num_seqs=256, max_num_batched_tokens=None, seed=0, tensor_parallel_size=1,
                            gpu_memory_utilization=0.9, kv_cache_memory=None, batch_size=a.batch_size,
                            input_len=a.input_len, output_len=a.output_len, num_iters_warmup=1, num_iters=a.iters,
                            enforce_eager=False, async_scheduling=None, enable_prefix_caching=False, profile=False)
    ours = run_latency(ns)
    gc.collect()
    torch.cuda.empty_cache()
    ours_tps = a.batch_size * a.output_len / ours["p50_latency_s"]
    # HF in a fresh process: two copies of a 30B model do not fit one GPU, and ours must be gone.
    hf = subprocess.run([sys.executable, os.path.abspath(__file__), "--hf-only", "--shape", a.shape,
                         "--batch-size", str(a.batch_size), "--input-len", str(a.input_len),
                         "--output-len", str(a.output_len), "--iters", str(a.iters)],
                        capture_output=True, text=True)
    if hf.returncode != 0:
        raise SystemExit(f"the HF run failed:\n{hf.stderr[-3000:]}")
    hf_tps = json.loads(hf.stdout.strip().splitlines()[-1])["hf_tokens_per_s"]
    result = {"shape": a.shape, "batch_size": a.batch_size, "input_len": a.input_len, "output_len": a.output_len,
              "ours_tokens_per_s": ours_tps, "hf_tokens_per_s": hf_tps, "ratio_vs_hf": ours_tps / hf_tps,
              "decode_step_ms": ours["decode_step_ms"], "roofline_step_ms": ours["roofline_step_ms"],
              "step_vs_roofline": ours["step_vs_roofline"], "bandwidth_gb_s": ours["bandwidth_gb_s"],
              "device": torch.cuda.get_device_name()}
    report(result, a.json)


if __name__ == "__main__":
    main()
