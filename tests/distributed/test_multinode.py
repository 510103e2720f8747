"""Two nodes on loopback, torchrun-style: node 0 runs the engine, node 1 `shardserve worker`."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from shardserve import LLM, SamplingParams
from shardserve.executor.multiproc import free_port
from shardserve.executor.worker_proc import no_delay
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
            assert all(_nodelay(c) for c in llm.engine.executor.conns)
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


def _nodelay(conn) -> bool:
    sock = socket.socket(fileno=conn.fileno())
    try:
        return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    finally:
        sock.detach()   # the connection still owns the descriptor


def test_engine_and_worker_ends_send_without_delay():
    """Both ends of an engine-worker connection turn Nagle's algorithm off (a step's message must not
    wait for the worker's previous reply to carry the acknowledgement), and still carry messages."""
    from multiprocessing.connection import Client, Listener
    with Listener(("127.0.0.1", 0), authkey=b"k") as listener:
        dialled = {}
        thread = threading.Thread(target=lambda: dialled.update(conn=no_delay(Client(listener.address, authkey=b"k"))))
        thread.start()
        engine_end = no_delay(listener.accept())
        thread.join()
        worker_end = dialled["conn"]
        assert _nodelay(engine_end) and _nodelay(worker_end)
        worker_end.send(("ok", [1, 2]))
        assert engine_end.recv() == ("ok", [1, 2])
        engine_end.close()
        worker_end.close()
