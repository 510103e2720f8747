"""Speculative decoding on CUDA: verification steps (short prefill chunks sampled at every position)
beside CUDA-graph decodes give the greedy tokens of no speculation, with n-gram drafts and with a
draft model (the target as its own draft: nearly every draft accepted), on a tiny fp32 model whose
head_dim (32) puts decodes on the Triton kernel inside CUDA graphs; sampled requests run too."""
from __future__ import annotations

import gc

import pytest
import torch

from shardserve import LLM, SamplingParams
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("GPU-only: needs CUDA", allow_module_level=True)

PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 200, 100, 42] * 3, [7, 8, 9], list(range(100, 180)),
           [300, 12, 7] * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _run(path: str, spec: dict | None):
    llm = LLM(path, device="cuda", dtype="float32", show_progress=False, gpu_memory_utilization=0.3,
              max_model_len=512, speculative_config=spec)
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        stats = llm.engine.stats()   # of the greedy requests
        sampled = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=3,
                                                       ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 20 for o in sampled)
        runner = llm.engine.executor.worker.model_runner
        graphs = runner.graphs is not None and (runner.drafter is None or runner.drafter.graphs is not None)
        return tokens, stats, graphs
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()   # the next engine profiles the GPU's free memory
        torch.cuda.empty_cache()


def test_drafts_on_cuda_match_no_speculation(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "tiny"), "llama", num_hidden_layers=4, hidden_size=128,
                                intermediate_size=256)
    reference, _, graphs = _run(path, None)
    assert graphs   # decodes replay CUDA graphs
    ngram, stats, graphs = _run(path, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    assert ngram == reference and stats.spec_decoding.num_accepted_tokens > 0 and stats.kv_cache_usage == 0
    assert graphs   # with speculation too: plain decode steps still replay graphs
    draft, stats, graphs = _run(path, {"model": path, "num_speculative_tokens": 4})
    assert graphs   # the draft's passes too
    assert draft == reference
    assert stats.spec_decoding.acceptance_rate > 0.95   # the target drafting for itself (eager vs graphs)
