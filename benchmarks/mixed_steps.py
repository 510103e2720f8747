"""Steps that mix decodes with prefill chunks, warm: a burst of short prompts served under a small
token budget (so new prompts' chunks share steps with running decodes), timed after a warm-up run
in the same process (a cold process first compiles and loads kernels). For A/B runs of the
piecewise graphs:

    SHARDSERVE_PIECEWISE_GRAPHS=1|0 python3 benchmarks/mixed_steps.py [--shape llama-3-8b] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve import LLM, SamplingParams  # noqa: E402
from shardserve.bench.report import save  # noqa: E402
from shardserve.bench.shapes import shape_config, write_shape_dir  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", help="write the measurements here")
    a = p.parse_args()
    config = shape_config(a.shape)
    llm = LLM(write_shape_dir(config, a.shape), load_format="dummy", skip_tokenizer_init=True, device="cuda",
              dtype="bfloat16", show_progress=False, enable_prefix_caching=False,
              max_num_batched_tokens=a.max_num_batched_tokens)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True, detokenize=False)

    def burst() -> float:
        prompts = [torch.randint(1000, config["vocab_size"] - 1, (a.input_len,), generator=g).tolist()
                   for _ in range(a.num_prompts)]
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    burst()   # warm-up
    seconds = [burst() for _ in range(a.iters)]
    tokens = a.num_prompts * a.output_len
    result = {"shape": a.shape, "num_prompts": a.num_prompts, "input_len": a.input_len, "output_len": a.output_len,
              "max_num_batched_tokens": a.max_num_batched_tokens, "seconds": seconds,
              "output_tokens_per_s": [tokens / s for s in seconds],
              "piecewise_graphs": os.environ.get("SHARDSERVE_PIECEWISE_GRAPHS", "default")}
    print(f"{a.num_prompts} prompts x {a.input_len} in / {a.output_len} out, budget {a.max_num_batched_tokens}: "
          + ", ".join(f"{tokens / s:.0f}" for s in seconds) + " output tokens/s")
    llm.engine.shutdown()
    if a.json:
        save(result, a.json)


if __name__ == "__main__":
    main()
