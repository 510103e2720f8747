"""`shardserve doctor`: are the GPUs, links, RDMA and NCCL settings what serving needs (docs/planner.md)."""
from __future__ import annotations


def run_doctor(**kwargs) -> int:
    from shardserve.doctor.run import run_doctor as run
    return run(**kwargs)
