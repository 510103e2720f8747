"""Where a decode step's time goes on GPUs: one CUDA-graph replay of the model (device time alone,
on every rank) against a whole engine step at the same batch (replay + LM head + sampling + input
preparation + bookkeeping), and with --profile the kernels of one replay.

    python3 benchmarks/graph_replay_time.py --shape llama-3-8b --batch-size 1 [-tp 2] [--profile]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve import LLM, SamplingParams  # noqa: E402
from shardserve.bench.report import save  # noqa: E402
from shardserve.bench.shapes import shape_config, write_shape_dir  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--profile", action="store_true", help="also list the kernels of one replay (rank 0)")
    p.add_argument("--json", help="write the measurements here")
    a = p.parse_args()
    llm = LLM(write_shape_dir(shape_config(a.shape), a.shape), load_format="dummy", skip_tokenizer_init=True,
              device="cuda", dtype="bfloat16", show_progress=False, async_scheduling=a.async_scheduling,
              tensor_parallel_size=a.tensor_parallel_size, max_model_len=a.max_model_len)
    ranks = llm.engine.executor.collective_rpc("profile_decode_graph", (a.batch_size, 256))
    prompts = [[7] * 128] * a.batch_size
    params = SamplingParams(temperature=0, max_tokens=257, ignore_eos=True, detokenize=False)
    # warm-up with the timed runs' sampling (greedy: its argmax kernel compiles here, not in the timed prefill)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, detokenize=False), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    step_ms = (time.perf_counter() - t - prefill) / 256 * 1000
    replay_ms = max(r["replay_ms"] for r in ranks)
    print(f"{a.shape} TP={a.tensor_parallel_size} batch {a.batch_size}, async scheduling "
          f"{'on' if a.async_scheduling else 'off'}: graph replay {replay_ms:.2f} ms (device, slowest rank; 256 tokens "
          f"of context), engine decode step {step_ms:.2f} ms, the rest {step_ms - replay_ms:.2f} ms")
    if a.profile:
        r = ranks[0]
        print(f"rank 0: {r['kernels_per_replay']} kernels per replay, {r['kernel_ms']:.3f} ms of kernel time")
        for k in r["kernels"][:15]:
            print(f"  {k['ms']:7.3f} ms  {k['count']:4d}x  {k['name'][:90]}")
    save({"ranks": ranks, "engine_step_ms": step_ms, "args": vars(a)}, a.json)
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
