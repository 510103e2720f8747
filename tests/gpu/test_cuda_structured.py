"""Structured outputs on CUDA: the bitmask copied from pinned host rows and applied to the logits on
the device, under async scheduling (on by default here) and CUDA graphs, with and without n-gram
drafts (each draft row masked for its own grammar state). Needs xgrammar (carried to GPU hosts that
lack it; skipped otherwise)."""
from __future__ import annotations

import gc

import pytest
import torch

from shardserve import LLM
from tests.structured.test_structured_tiny import _batch, _check
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("GPU-only: needs CUDA", allow_module_level=True)
pytest.importorskip("xgrammar", reason="the GPU hosts have no xgrammar unless a run carries its wheel "
                    "(CPU CI always has it: tests/structured)")


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}])
def test_grammars_hold_on_cuda(tmp_path, spec):
    path = make_tiny_checkpoint(str(tmp_path / "tiny"), "llama", num_hidden_layers=2, hidden_size=128,
                                intermediate_size=256)
    llm = LLM(path, device="cuda", dtype="float32", show_progress=False, gpu_memory_utilization=0.2,
              max_model_len=256, speculative_config=spec)
    try:
        assert llm.engine.async_scheduling
        _check(llm.generate(*_batch(12), use_tqdm=False))
        if spec is not None:
            assert llm.engine.stats().spec_decoding.num_drafts > 0
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
