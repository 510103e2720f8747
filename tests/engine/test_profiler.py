"""torch.profiler traces of the workers, vLLM-style: a directory in the environment, then
start_profile / stop_profile; one gzipped Chrome trace per worker, and clear errors for misuse."""
from __future__ import annotations

import gzip
import json
import os

import pytest

from shardserve import LLM, SamplingParams
from tests.tiny_models import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_profile")), "llama")


@pytest.fixture(autouse=True)
def no_profiler_env(monkeypatch):
    for prefix in ("SHARDSERVE", "VLLM"):
        for setting in ("DIR", "WITH_STACK", "RECORD_SHAPES"):
            monkeypatch.delenv(f"{prefix}_TORCH_PROFILER_{setting}", raising=False)


def _events(path: str) -> list[dict]:
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


def _ops(path: str) -> set[str]:
    return {e.get("name", "") for e in _events(path)}


def test_profiling_needs_a_trace_directory(tiny):
    llm = LLM(tiny, kv_cache_memory="16MiB", show_progress=False)
    with pytest.raises(ValueError, match="SHARDSERVE_TORCH_PROFILER_DIR"):
        llm.start_profile()


def test_each_worker_writes_its_trace(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))   # vLLM's name works too
    llm = LLM(tiny, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=2)
    try:
        with pytest.raises(ValueError, match="not running"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(ValueError, match="already running"):
            llm.start_profile()
        first = llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        traces = llm.stop_profile()
        assert [os.path.basename(p).split("-")[0] for p in traces] == ["rank0", "rank1"]
        for path in traces:
            assert os.path.dirname(path) == str(tmp_path / "traces")
            assert any(name.startswith("aten::") for name in _ops(path)), "the trace holds the step's ops"
            # Python call stacks by default, as vLLM's traces: the model's own functions show
            assert any(e.get("cat") == "python_function" and "llama.py" in e.get("name", "") for e in _events(path))
        # misuse stopped nothing: the engine still serves, with the same tokens
        assert llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    finally:
        llm.engine.shutdown()


def test_stacks_off_and_shapes_on(tiny, tmp_path, monkeypatch):
    """VLLM_TORCH_PROFILER_WITH_STACK=0 leaves the Python stacks out; ..._RECORD_SHAPES=1 adds
    each op's input shapes."""
    monkeypatch.setenv("SHARDSERVE_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_TORCH_PROFILER_WITH_STACK", "0")
    monkeypatch.setenv("SHARDSERVE_TORCH_PROFILER_RECORD_SHAPES", "1")
    llm = LLM(tiny, kv_cache_memory="16MiB", show_progress=False)
    try:
        llm.start_profile()
        llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)
        [path] = llm.stop_profile()
    finally:
        llm.engine.shutdown()
    events = _events(path)
    assert not any(e.get("cat") == "python_function" for e in events)
    assert any("Input Dims" in e.get("args", {}) for e in events if e.get("cat") == "cpu_op")
