"""Two nodes on loopback, torchrun-style: node 0 runs the engine, node 1 `shardserve worker`."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from shardserve import LLM, SamplingParams
from shardserve.executor.multiproc import free_port
from tests.tiny_models import make_tiny_checkpoint

PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 200, 100, 42] * 3, list(range(1, 10))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def cluster_key(monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CLUSTER_KEY", "test-secret")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_mn")), "llama")


def _headless(port: int, **extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "shardserve.cli", "worker", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port), "-tp", "2"]
    return subprocess.Popen(args)


def test_two_nodes_on_loopback_match_single_device(tiny):
    single = LLM(tiny, kv_cache_memory="16MiB", show_progress=False)
    reference = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
    port = free_port()
    node1 = _headless(port)   # may start before the engine: its workers retry until it listens
    try:
        llm = LLM(tiny, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=2, nnodes=2,
                  node_rank=0, master_addr="127.0.0.1", master_port=port)
        try:
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
            assert len(llm.engine.executor.procs) == 1   # only rank 0 runs on the engine's node
        finally:
            llm.engine.shutdown()
        assert node1.wait(timeout=30) == 0   # the headless node exits with the engine
    finally:
        node1.kill()


def test_missing_node_is_a_timeout_naming_ranks_and_address(tiny):
    port = free_port()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"worker ranks \[1\] did not connect to the engine at 127.0.0.1:{port + 1}"
                                           r".*shardserve worker --nnodes 2"):
        LLM(tiny, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=2, nnodes=2, node_rank=0,
            master_addr="127.0.0.1", master_port=port, distributed_timeout_s=3)
    assert time.monotonic() - start < 30


def test_multi_node_needs_a_cluster_key(tiny, monkeypatch):
    monkeypatch.delenv("SHARDSERVE_CLUSTER_KEY")
    with pytest.raises(ValueError, match="SHARDSERVE_CLUSTER_KEY"):
        LLM(tiny, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=2, nnodes=2, node_rank=0,
            master_addr="127.0.0.1", master_port=free_port())
