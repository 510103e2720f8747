"""Async scheduling on CUDA gives the synchronous engine's results: the device-side pieces (pinned
copies, tokens fed from the previous step's samples, penalty counts of in-flight tokens, seeded
draws at the right position, min_tokens masks) on a tiny fp32 model. Every request runs the same
number of steps, so both modes see the same batches and even logprobs must match. The model's
head_dim (32) puts decodes on the Triton kernel inside CUDA graphs and prefills on the Triton
prefill kernel."""
from __future__ import annotations

import pytest
import torch

from shardserve import LLM, SamplingParams
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("GPU-only: needs CUDA", allow_module_level=True)

PROMPTS = [list(range(5, 40)), [7, 8, 9], list(range(100, 180)), [300, 12, 7] * 9]
PARAMS = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3),
          SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.7, seed=5, max_tokens=16, ignore_eos=True, repetition_penalty=1.4,
                         frequency_penalty=0.6, presence_penalty=0.3),
          SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, min_tokens=6)]


def _run(path: str, async_scheduling: bool):
    llm = LLM(path, device="cuda", dtype="float32", show_progress=False, gpu_memory_utilization=0.3,
              max_model_len=512, async_scheduling=async_scheduling)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs or []]) for o in outs]
    finally:
        llm.engine.shutdown()


def test_async_scheduling_matches_sync_on_cuda(tmp_path):
    # head_dim 32: the Triton kernels and CUDA graphs take it (the default tiny head_dim, 24, does not)
    path = make_tiny_checkpoint(str(tmp_path / "tiny"), "llama", num_hidden_layers=4, hidden_size=128,
                                intermediate_size=256)
    sync = _run(path, False)
    assert _run(path, True) == sync
