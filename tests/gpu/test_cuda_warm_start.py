"""After start-up, serving compiles no Triton kernel. A kernel variant first met mid-run (a new
constexpr, pointer dtype or pointer alignment) stalls its step while Triton compiles it, about half a
second each on a fresh machine; on the 8B offline-throughput workload that was MFU 30% instead of
35%. So the engine compiles every variant its steps use while it starts (graph capture, and two
warm-up steps ending in a decode beside a prefill chunk), and its per-step inputs keep their
pointers aligned whatever the step's size. Each case runs in a fresh process: Triton's in-process
kernel cache would hide variants that earlier tests compiled."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

MARK = "COMPILES "


def _serve(path: str, budget: int) -> tuple[list, dict]:
    """In this (fresh) process: start an engine, serve a mixed workload, and return the kernel
    variants compiled after start-up, with the variants of the same kernels compiled before."""
    import triton

    from shardserve import LLM, SamplingParams
    compiled = []   # (after start-up?, kernel, specialisation key) of each variant compiled
    serving = []
    triton.knobs.runtime.jit_cache_hook = lambda **kw: compiled.append((bool(serving), kw["fn"].name, str(kw["key"])))
    llm = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_num_seqs=8,
              max_num_batched_tokens=budget, enable_prefix_caching=True, show_progress=False)
    serving.append(True)
    g = torch.Generator().manual_seed(0)
    # Odd and even sizes, prompts longer than the budget (chunks with a context), a prefix hit, and
    # more requests than max_num_seqs, so steps of every kind come up: decode-only, prefill-only,
    # mixed, small and large.
    prompts = [torch.randint(10, 300, (n,), generator=g).tolist() for n in (3, 17, 40, 101, 7, 250, 64, 9, 33, 130)]
    prompts.append(prompts[5][:200] + [1, 2, 3])
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, ignore_eos=True, seed=3)
    try:
        outs = llm.generate(prompts, [greedy if i % 3 else sampled for i in range(len(prompts))], use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outs] == [9 if i % 3 == 0 else 24 for i in range(len(prompts))]
    late = [(name, key) for after, name, key in compiled if after]
    early = {name: [key for after, n, key in compiled if n == name and not after] for name, _ in late}
    return late, early


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: needs CUDA and Triton")
@pytest.mark.parametrize("budget", [64, 2048])
def test_serving_compiles_no_kernel_after_start_up(tmp_path, budget):
    from tests.tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, os.path.abspath(__file__), path, str(budget)], capture_output=True,
                         text=True, timeout=600, env=env, cwd=root)
    assert run.returncode == 0, run.stderr[-4000:]
    late, early = json.loads(next(line for line in run.stdout.splitlines() if line.startswith(MARK))[len(MARK):])
    assert not late, f"compiled while serving: {late}; the same kernels at start-up: {early}"


if __name__ == "__main__":   # the fresh process: CHECKPOINT BUDGET
    print(MARK + json.dumps(_serve(sys.argv[1], int(sys.argv[2]))), flush=True)
