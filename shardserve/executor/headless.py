"""A headless node of a multi-node run: starts this node's worker processes, which dial the engine
on node 0 and serve it until it shuts down (`shardserve worker --nnodes N --node-rank R ...`)."""
from __future__ import annotations

import logging
import os
import signal
import time

from shardserve.executor.multiproc import cluster_key, spawn_worker

logger = logging.getLogger("shardserve")


def run_headless_node(nnodes: int, node_rank: int, master_addr: str, master_port: int, world_size: int,
                      threads: int | None = None, connect_timeout_s: float | None = None) -> int:
    if not 0 < node_rank < nnodes:
        raise ValueError(f"a headless node needs 0 < node_rank < nnodes={nnodes} (node 0 runs the engine)")
    if world_size % nnodes:
        raise ValueError(f"{world_size} ranks cannot be spread evenly over {nnodes} nodes")
    per_node = world_size // nnodes
    threads = threads or max(1, (os.cpu_count() or 1) // per_node)
    ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    logger.info("node %d: starting worker ranks %s for the engine at %s:%d", node_rank, list(ranks),
                master_addr, master_port + 1)
    procs = [spawn_worker(master_addr, master_port + 1, r, cluster_key(), threads, connect_timeout_s) for r in ranks]

    def stop(*_):
        for p in procs:
            p.terminate()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes = []
    for p in procs:
        while p.poll() is None:
            time.sleep(0.2)
        codes.append(p.returncode)
    return max(codes, key=abs)
