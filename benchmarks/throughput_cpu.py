"""W-CPU: offline throughput and single-stream decode of SmolLM2-135M on the CPU, beside HF
transformers' generate() on the same weights, dtype and machine, in one run.

    .venv/bin/python benchmarks/throughput_cpu.py [--dtype bfloat16] [--num-prompts 64] [--json out.json]

Workload (issue 2): 64 requests, random prompts of 64-256 tokens, 128 output tokens each
(ignore_eos), plus one single-stream run of 128 tokens. HF runs single-stream and at batch 16
(left-padded random prompts of the same lengths), the shapes of the figures quoted for vLLM.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import torch

from shardserve.bench.report import report


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def bench_ours(args, prompts):
    from shardserve import LLM, SamplingParams
    llm = LLM(dtype=args.dtype, kv_cache_memory="2GiB", show_progress=False, max_num_seqs=args.num_prompts,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    batch_s = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    t = time.perf_counter()
    one = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    single_s = time.perf_counter() - t
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0].text
    return {"offline_tok_s": n_out / batch_s, "offline_s": batch_s, "output_tokens": n_out,
            "single_stream_tok_s": len(one.outputs[0].token_ids) / single_s, "france_answer": answer}


def bench_hf(args, prompts):
    from transformers import AutoModelForCausalLM

    from shardserve.models.loader import default_model_path
    path = default_model_path()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=dtype).eval()
    gen = dict(do_sample=False, min_new_tokens=args.output_len, max_new_tokens=args.output_len, pad_token_id=2)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=4, do_sample=False, pad_token_id=2)
        t = time.perf_counter()
        out = model.generate(torch.tensor([prompts[0]]), **gen)
        single = (out.shape[1] - len(prompts[0])) / (time.perf_counter() - t)
        batch = prompts[:args.hf_batch]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[2] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **gen)
        batch_tok_s = len(batch) * (out.shape[1] - width) / (time.perf_counter() - t)
    return {"single_stream_tok_s": single, f"batch{args.hf_batch}_tok_s": batch_tok_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-min", type=int, default=64)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    prompts = random_prompts(args.num_prompts, args.input_len_min, args.input_len_max, 49152, args.seed)
    machine = platform.processor() or platform.machine()
    result = {"machine": f"{machine}, {os.cpu_count()} cores, torch {torch.__version__}, "
                         f"{torch.get_num_threads()} threads", "dtype": args.dtype, "ours": bench_ours(args, prompts)}
    print(json.dumps(result, indent=2), flush=True)
    if not args.skip_hf:
        result["hf"] = bench_hf(args, prompts)
        ours, hf = result["ours"], result["hf"]
        result["ratio_single_stream"] = ours["single_stream_tok_s"] / hf["single_stream_tok_s"]
        result[f"ratio_offline_vs_hf_batch{args.hf_batch}"] = ours["offline_tok_s"] / hf[f"batch{args.hf_batch}_tok_s"]
    report(result, args.json)


if __name__ == "__main__":
    main()
