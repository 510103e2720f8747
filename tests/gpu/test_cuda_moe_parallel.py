"""MoE layouts over NCCL on two GPUs: a tiny Qwen3-MoE checkpoint in fp32 (exact enough that any
layout must give one GPU's greedy tokens): experts sliced over TP=2, whole experts over EP=2, and
EP spanning two data-parallel replicas (the token all-gather and NCCL reduce-scatter per layer)."""
from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 200, 100, 42] * 3, list(range(1, 10)), [300, 12, 7] * 9]


def _tokens(path: str, lengths=(12, 4, 8), **kwargs) -> list[list[int]]:
    from shardserve import LLM, SamplingParams
    llm = LLM(path, dtype="float32", device="cuda", enforce_eager=True, gpu_memory_utilization=0.3,
              show_progress=False, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="GPU-only: MoE layouts over NCCL need two CUDA GPUs")
def test_moe_layouts_match_one_gpu(tmp_path):
    from tests.tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(str(tmp_path / "qwen3_moe"), "qwen3_moe", num_hidden_layers=4)
    reference = _tokens(path)
    assert _tokens(path, tensor_parallel_size=2) == reference
    assert _tokens(path, tensor_parallel_size=2, enable_expert_parallel=True) == reference
    # Replica 1 gets the 4-token request and steps idle while replica 0 still needs its experts.
    assert _tokens(path, data_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=60) == reference
