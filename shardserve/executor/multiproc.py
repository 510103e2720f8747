"""One worker process per device (the default for more than one device on a node).

Workers are started as `python -m shardserve.executor.worker_proc` (not multiprocessing's spawn, so
user scripts need no `if __name__ == "__main__"` guard) and connect back to the engine over an
authenticated local socket. The engine sends each RPC to every worker and waits for all answers.
A worker that dies is noticed within a poll interval: the call fails with an error naming its rank,
the other workers are stopped, and nothing is left running. Workers also die with the engine's
process (each watches its parent), so Ctrl-C or a crash leaves no orphans.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, Listener, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from shardserve.config import EngineConfig
from shardserve.distributed.parallel_state import host_store
from shardserve.executor.base import Executor, WorkerDiedError
from shardserve.executor.worker_proc import no_delay

_POLL_S = 0.5
_LOCAL_START_S = 300.0   # the longest this node's own workers may take to dial in, across nodes


def cluster_key() -> bytes:
    """The secret every node's workers prove when they dial the engine: SHARDSERVE_CLUSTER_KEY, set
    to the same value on all nodes. Required: the engine unpickles what authenticated peers send."""
    key = os.environ.get("SHARDSERVE_CLUSTER_KEY")
    if not key:
        raise ValueError("a multi-node run needs SHARDSERVE_CLUSTER_KEY set to the same secret on every node "
                         "(e.g. export SHARDSERVE_CLUSTER_KEY=$(openssl rand -hex 16))")
    return key.encode()


def spawn_worker(host: str, port: int, rank: int, authkey: bytes, threads: int,
                 connect_timeout_s: float | None = None) -> subprocess.Popen:
    """connect_timeout_s: how long the worker dials an engine that is not there yet (a headless node's)."""
    env = dict(os.environ, SHARDSERVE_WORKER_AUTHKEY=authkey.hex(), OMP_NUM_THREADS=str(threads))
    if connect_timeout_s is not None:
        env["SHARDSERVE_WORKER_CONNECT_TIMEOUT_S"] = str(connect_timeout_s)
    return subprocess.Popen([sys.executable, "-m", "shardserve.executor.worker_proc", host, str(port), str(rank)],
                            env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset(),
                 show_progress: bool = True, replica: int = 0) -> None:
        parallel_config = config.parallel_config
        startup_timeout_s = parallel_config.distributed_timeout_s
        self.world_size = parallel_config.world_size
        first_device = replica * self.world_size
        self.output_rank = (parallel_config.pipeline_parallel_size - 1) * parallel_config.tensor_parallel_size
        if parallel_config.nnodes > 1 and parallel_config.data_parallel_size > 1:
            raise ValueError("data parallelism across nodes is not supported; use tensor/pipeline parallelism")
        per_node = parallel_config.ranks_per_node
        self._store = None
        if parallel_config.data_parallel_master:   # experts span replicas: one rendezvous for all (dp_engine.py)
            init_method = parallel_config.data_parallel_master
            address, authkey = ("127.0.0.1", 0), secrets.token_bytes(16)
        elif parallel_config.nnodes > 1:   # remote ranks dial in to the engine at master_port + 1
            init_method = f"tcp://{parallel_config.master_addr}:{parallel_config.master_port}"
            # Every interface: this node's own ranks dial 127.0.0.1, the others master_addr (in a pod,
            # the leader's DNS name: its pod IP, not loopback).
            address, authkey = ("", parallel_config.master_port + 1), cluster_key()
        else:   # the engine hosts the ranks' rendezvous store for as long as they run
            self._store, init_method = host_store(self.world_size, startup_timeout_s)
            address, authkey = ("127.0.0.1", 0), secrets.token_bytes(16)
        procs_total = per_node * parallel_config.data_parallel_size
        threads = max(1, (os.cpu_count() or 1) // procs_total) if config.device.type == "cpu" else 1
        self.procs: dict[int, subprocess.Popen] = {}   # local ranks only
        self.conns: list[Connection] = []
        with Listener(address, authkey=authkey) as listener:
            port = listener.address[1]
            for rank in range(per_node):
                self.procs[rank] = spawn_worker("127.0.0.1", port, rank, authkey, threads)
            try:
                by_rank: dict[int, Connection] = {}
                while len(by_rank) < self.world_size:
                    conn = self._accept(listener, startup_timeout_s, parallel_config, sorted(by_rank))
                    rank = conn.recv()
                    if not isinstance(rank, int) or not 0 <= rank < self.world_size or rank in by_rank:
                        conn.close()   # not one of ours, or a rank already taken
                        continue
                    by_rank[rank] = conn
                self.conns = [by_rank[r] for r in range(self.world_size)]
                for rank, conn in enumerate(self.conns):
                    conn.send((config, rank, first_device + rank % per_node, init_method, eos_token_ids,
                               show_progress and rank == self.output_rank and replica == 0, threads))
                self._gather(startup_timeout_s)
                self.collective_rpc("load_model")
            except BaseException:
                self.shutdown()
                raise

    def _accept(self, listener: Listener, timeout_s: float, parallel_config, connected: list[int]) -> Connection:
        """accept() that gives up if a local worker dies first or the deadline passes. Across nodes,
        the deadline waits for peers: it runs only once this node's own workers are in (they may take
        longer than a short timeout to start; a dead one fails at once, a hung one after _LOCAL_START_S),
        so the error names the ranks of the nodes that never came."""
        sock = listener._listener._socket
        now = time.monotonic()
        deadline, local_deadline = now + timeout_s, now + max(timeout_s, _LOCAL_START_S)
        sock.settimeout(_POLL_S)
        while True:
            try:
                return no_delay(listener.accept())
            except (socket.timeout, TimeoutError):
                for rank, proc in self.procs.items():
                    if proc.poll() is not None:
                        self._fail(rank)
                now = time.monotonic()
                starting = [r for r in self.procs if r not in connected]
                if parallel_config.nnodes > 1 and starting and now < local_deadline:
                    deadline = now + timeout_s
                if now > deadline:
                    missing = sorted(set(range(self.world_size)) - set(connected))
                    host = parallel_config.master_addr if parallel_config.nnodes > 1 else listener.address[0]
                    raise TimeoutError(
                        f"worker ranks {missing} did not connect to the engine at {host}:"
                        f"{listener.address[1]} within {timeout_s:.0f} s" + (
                            f"; start the other nodes with `shardserve worker --nnodes {parallel_config.nnodes} "
                            f"--node-rank N --master-addr {parallel_config.master_addr} "
                            f"--master-port {parallel_config.master_port}`" if parallel_config.nnodes > 1 else ""))

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        self._send_all(method, args, kwargs or {})
        return self._gather(timeout_s)

    def submit_execute(self, sched) -> None:
        self._send_all("launch", (sched,), {})   # answered once the device has the step's results

    def _send_all(self, method: str, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.conns:
            raise RuntimeError("the engine's workers are stopped (after a failure or shutdown)")
        message = ForkingPickler.dumps((method, args, kwargs))   # pickled once for every rank (what send() does)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except (BrokenPipeError, OSError):
                self._fail(rank)

    def collect_execute(self):
        return self._gather(None)[self.output_rank]

    def _gather(self, timeout_s: float | None) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = dict(enumerate(self.conns))
        while pending:
            for conn in wait(list(pending.values()), timeout=_POLL_S):
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    self._fail(rank)
                if status == "error":
                    self.shutdown()
                    raise RuntimeError(f"worker rank {rank} failed: {value}")
                results[rank] = value
                del pending[rank]
            for rank in pending:
                if rank in self.procs and self.procs[rank].poll() is not None:
                    self._fail(rank)
            if deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise TimeoutError(f"workers {sorted(pending)} did not answer within {timeout_s:.0f} s")
        return [results[r] for r in range(len(self.conns))]

    def check_health(self) -> None:
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                self._fail(rank)

    def _fail(self, rank: int) -> None:
        proc = self.procs.get(rank)
        code = proc.poll() if proc else None
        self.shutdown()
        where = f"(pid {proc.pid})" if proc else "(on another node)"
        exit_code = f" with exit code {code}" if code is not None else ""
        raise WorkerDiedError(f"worker rank {rank} {where} died{exit_code}")

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("shutdown", (), {}))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
        for conn in self.conns:
            conn.close()
        self.conns = []
        self._store = None   # only now: the ranks poll it until they exit
