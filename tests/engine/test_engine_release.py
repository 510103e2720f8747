"""An engine's model and KV pool go when the last reference does, without waiting for the garbage
collector: no reference cycles through them. On a GPU a cycle kept gigabytes held until the next
collection, so the next engine in the same process found no memory for its KV cache."""
from __future__ import annotations

import gc
import weakref

import pytest

from shardserve import LLM, SamplingParams
from tests.tiny_models import make_tiny_checkpoint


@pytest.mark.parametrize("spec", ["none", "ngram", "draft"])
def test_model_and_kv_pool_are_freed_by_reference_counting(tmp_path, spec):
    path = make_tiny_checkpoint(str(tmp_path / "tiny"), "llama", num_hidden_layers=2)
    config = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": 2},
              "draft": {"model": path, "num_speculative_tokens": 2}}[spec]
    gc.collect()
    gc.disable()
    try:
        llm = LLM(path, show_progress=False, kv_cache_memory="16MiB", speculative_config=config)
        llm.generate([[1, 2, 3, 1, 2]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        runner = llm.engine.executor.worker.model_runner
        refs = [weakref.ref(runner.model), *(weakref.ref(pool) for pool in runner.kv_pools)]
        del runner
        llm.engine.shutdown()
        del llm
        assert [ref() is None for ref in refs] == [True] * len(refs)
    finally:
        gc.enable()
