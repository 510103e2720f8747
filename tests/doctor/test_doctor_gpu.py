"""`shardserve doctor` on a GPU machine (skipped without CUDA): NCCL benchmark, transport
detection from NCCL_DEBUG=INFO, HBM bandwidth in the profile."""
from __future__ import annotations

import json

import pytest
import torch

from shardserve.doctor import run_doctor

pytestmark = pytest.mark.gpu


def test_doctor_on_gpus(tmp_path, capsys):
    path = tmp_path / "doctor.json"
    run_doctor(json_path=str(path), timeout=180)
    doc = json.loads(path.read_text())
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["gpus"]["status"] == "PASS" and doc["profile"]["hbm_bandwidth"] > 1e11
    if torch.cuda.device_count() >= 2:
        assert checks["allreduce"]["status"] == "PASS" and checks["allreduce"]["data"]["backend"] == "nccl"
        assert checks["transport"]["status"] in ("PASS", "WARN")
        assert doc["allreduce"]["nccl_local"]["channels"] > 0 and doc["allreduce"]["nccl_local"]["version"]
        assert doc["profile"]["links"]["intra_node"]["world"] == torch.cuda.device_count()
