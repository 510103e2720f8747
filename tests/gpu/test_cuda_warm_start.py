"""After start-up, serving compiles no Triton kernel. A kernel variant first met mid-run (a new
constexpr, pointer dtype or pointer alignment) stalls its step while Triton compiles it, about half a
second each on a fresh machine; on the 8B offline-throughput workload that was MFU 30% instead of
35%. So the engine compiles every variant its steps use while it starts (graph capture, and two
warm-up steps ending in a decode beside a prefill chunk), and its per-step inputs keep their
pointers aligned whatever the step's size."""
from __future__ import annotations

import pytest
import torch

from shardserve import LLM, SamplingParams
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("GPU-only: needs CUDA and Triton", allow_module_level=True)


@pytest.mark.parametrize("budget", [64, 2048])
def test_serving_compiles_no_kernel_after_start_up(tmp_path, monkeypatch, budget):
    import triton
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2)
    compiled = []   # (after start-up?, kernel, specialisation key) of each variant compiled
    serving = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook",
                        lambda **kw: compiled.append((bool(serving), kw["fn"].name, str(kw["key"]))))
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
    early = {name: [key for after, n, key in compiled if n == name and not after] for _, name, _ in compiled}
    assert not late, f"compiled while serving: {late}; at start-up: {[early[n] for n, _ in late]}"
