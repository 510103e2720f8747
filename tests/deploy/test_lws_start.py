"""Two "nodes" on this machine started the way a LeaderWorkerSet starts them: the same commands as
deploy/k8s/leaderworkerset.yaml, with only LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX
telling each process its place. The leader address is this machine's own non-loopback address when it
has one (a pod's DNS name resolves to its pod IP), so the engine's own ranks and the remote ones both
reach it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from shardserve.executor.multiproc import free_port
from tests.server.server_process import ServerProcess, get, post
from tests.tiny_models import make_tiny_checkpoint


def _own_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))   # no packet is sent; only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def test_leader_and_worker_from_lws_env_serve_and_stop_together(tmp_path):
    tiny = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    port = free_port()
    group = {"LWS_LEADER_ADDRESS": _own_address(), "LWS_GROUP_SIZE": "2", "SHARDSERVE_CLUSTER_KEY": "lws-test"}
    cmd = [sys.executable, "-m", "shardserve.cli", "worker", "-tp", "2", "--master-port", str(port)]
    worker = subprocess.Popen(cmd,
                              env={**os.environ, **group, "LWS_WORKER_INDEX": "1"})
    leader = None
    try:
        leader = ServerProcess([tiny, "-tp", "2", "--master-port", str(port), "--kv-cache-memory", "16MiB",
                                "--served-model-name", "tiny"], str(tmp_path / "leader.log"),
                               env={**group, "LWS_WORKER_INDEX": "0"})
        log = leader.read_log()
        status, body, _ = post(leader.url + "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8,
                                                                "ignore_eos": True, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 8, body
        assert get(leader.url + "/health")[0] == 200
        assert worker.poll() is None   # node 1 serves rank 1
        assert leader.stop() == 0
        assert worker.wait(30) == 0     # the group goes down together
    finally:
        if leader is not None:
            leader.stop()
        worker.kill()
    assert "Traceback" not in log


def test_explicit_flags_win_over_lws_env(monkeypatch):
    from shardserve.cli import build_parser
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "leader.example")
    monkeypatch.setenv("LWS_GROUP_SIZE", "4")
    monkeypatch.setenv("LWS_WORKER_INDEX", "3")
    ns = build_parser().parse_args(["worker", "--master-port", "29500"])
    assert (ns.nnodes, ns.node_rank, ns.master_addr) == (4, 3, "leader.example")
    ns = build_parser().parse_args(["worker", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"])
    assert (ns.nnodes, ns.node_rank, ns.master_addr) == (2, 1, "10.0.0.1")


def test_no_lws_env_keeps_single_node_defaults(monkeypatch):
    from shardserve.cli import build_parser
    for var in ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"):
        monkeypatch.delenv(var, raising=False)
    ns = build_parser().parse_args(["serve"])
    assert (ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port) == (1, 0, "127.0.0.1", None)
