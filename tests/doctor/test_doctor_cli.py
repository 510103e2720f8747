"""`shardserve doctor` end to end on this CPU machine: checks, the gloo all-reduce benchmark, the
JSON profile and `plan --profile` reading it; the cross-node rendezvous on loopback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from shardserve.cli import main
from shardserve.doctor import allreduce
from shardserve.executor.multiproc import free_port

# These assert what doctor reports where there is no GPU (gloo, no NCCL); test_doctor_gpu.py covers GPUs.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the no-GPU report; a GPU machine "
                              "runs tests/doctor/test_doctor_gpu.py instead")


def _cli(*args: str, timeout: int = 180) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardserve.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


@cpu_only
def test_doctor_on_a_cpu_machine_writes_a_profile_plan_uses(tmp_path, capsys):
    path = tmp_path / "doctor.json"
    proc = _cli("doctor", "--json", str(path))
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err
    assert "no CUDA GPU visible" in out
    assert "PASS  allreduce  gloo, 2 ranks as 2 CPU processes on loopback: 8 KiB" in out
    assert "SKIP  transport" in out and "SKIP  peers" in out
    doc = json.loads(path.read_text())
    statuses = {c["name"]: c["status"] for c in doc["checks"]}
    assert set(statuses) == {"gpus", "versions", "topology", "rdma", "mtu", "nccl-env", "hbm", "allreduce",
                             "transport", "peers"}
    assert FAIL_FREE(statuses)
    link = doc["profile"]["links"]["intra_node"]
    assert link["backend"] == "gloo" and link["world"] == 2 and len(link["points"]) == len(allreduce.CPU_SIZES)
    assert link["latency_s"] > 0 and link["bandwidth"] > 0
    assert all(p["seconds"] > 0 and p["busbw"] > 0 for p in link["points"])
    assert main(["plan", "llama-3.1-8b", "--gpus-per-node", "2", "--profile", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["settings"]["interconnect"]["intra_node"]["latency_s"] == pytest.approx(link["latency_s"])
    assert "gloo" in plan["settings"]["profile"][0]


def FAIL_FREE(statuses: dict[str, str]) -> bool:
    return "FAIL" not in statuses.values()


def test_cross_node_rendezvous_on_loopback():
    """What `--peers` runs on each node: one rank per node meeting at the first peer's TCP store."""
    init = f"tcp://127.0.0.1:{free_port()}"
    runs: dict[int, dict] = {}

    def node(rank: int) -> None:
        runs[rank] = allreduce.run_ranks([rank], 2, init, "cpu", [8 << 10, 1 << 20], timeout=120, budget_s=0.05)

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in (0, 1):
        assert runs[rank]["error"] is None, runs[rank]["log"][-2000:]
        assert runs[rank]["result"]["rank"] == rank and runs[rank]["result"]["world"] == 2
        assert [p["bytes"] for p in runs[rank]["result"]["points"]] == [8 << 10, 1 << 20]


def test_benchmark_failure_is_reported_not_hung():
    run = allreduce.run_ranks([0], 2, f"tcp://127.0.0.1:{free_port()}", "cpu", [8192], timeout=3)
    assert run["result"] is None and "timed out after 3 s" in run["error"]


@pytest.mark.slow
@cpu_only
def test_doctor_peers_on_loopback(tmp_path):
    peers = f"127.0.0.1:{free_port()},127.0.0.1:0"
    procs = [_cli("doctor", "--peers", peers, "--node-rank", str(r), "--json", str(tmp_path / f"{r}.json"))
             for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
        assert "PASS  peers" in out and "across 2 nodes" in out
    doc = json.loads((tmp_path / "1.json").read_text())
    assert doc["profile"]["links"]["inter_node"]["world"] == 2
