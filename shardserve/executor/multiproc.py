"""One worker process per device (the default for more than one device on a node).

Workers are started as `python -m shardserve.executor.worker_proc` (not multiprocessing's spawn, so
user scripts need no `if __name__ == "__main__"` guard) and connect back to the engine over an
authenticated local socket. The engine sends each RPC to every worker and waits for all answers.
A worker that dies is noticed within a poll interval: the call fails with an error naming its rank,
the other workers are stopped, and nothing is left running. Workers also die with the engine's
process (parent-death signal), so Ctrl-C or a crash leaves no orphans.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from shardserve.config import EngineConfig
from shardserve.executor.base import Executor

_POLL_S = 0.5


class WorkerDiedError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset(),
                 show_progress: bool = True, startup_timeout_s: float = 300.0, replica: int = 0) -> None:
        pc = config.parallel_config
        self.world_size = pc.world_size
        first_device = replica * self.world_size
        self.output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        procs_total = self.world_size * pc.data_parallel_size
        threads = max(1, (os.cpu_count() or 1) // procs_total) if config.device.type == "cpu" else 1
        authkey = secrets.token_bytes(16)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        env = dict(os.environ, SHARDSERVE_WORKER_AUTHKEY=authkey.hex(), OMP_NUM_THREADS=str(threads))
        with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
            host, port = listener.address
            for rank in range(self.world_size):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "shardserve.executor.worker_proc", host, str(port), str(rank)], env=env))
            try:
                by_rank = {}
                for _ in range(self.world_size):
                    conn = self._accept(listener, startup_timeout_s)
                    by_rank[conn.recv()] = conn
                self.conns = [by_rank[r] for r in range(self.world_size)]
                for rank, conn in enumerate(self.conns):
                    conn.send((config, rank, first_device + rank, init_method, eos_token_ids,
                               show_progress and rank == self.output_rank and replica == 0, threads))
                self._gather(startup_timeout_s)
                self.collective_rpc("load_model")
            except BaseException:
                self.shutdown()
                raise

    def _accept(self, listener: Listener, timeout_s: float) -> Connection:
        """accept() that gives up if a worker dies before connecting or the deadline passes."""
        sock = listener._listener._socket
        deadline = time.monotonic() + timeout_s
        sock.settimeout(_POLL_S)
        while True:
            try:
                return listener.accept()
            except (socket.timeout, TimeoutError):
                for rank, proc in enumerate(self.procs):
                    if proc.poll() is not None:
                        self._fail(rank)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker processes did not connect within {timeout_s:.0f} s")

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        self._send_all(method, args, kwargs or {})
        return self._gather(timeout_s)

    def execute_model(self, sched):
        return self.collective_rpc("execute_model", (sched,))[self.output_rank]

    def submit_execute(self, sched) -> None:
        self._send_all("execute_model", (sched,), {})

    def _send_all(self, method: str, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.conns:
            raise RuntimeError("the engine's workers are stopped (after a failure or shutdown)")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((method, args, kwargs))
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
                if self.procs[rank].poll() is not None:
                    self._fail(rank)
            if deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise TimeoutError(f"workers {sorted(pending)} did not answer within {timeout_s:.0f} s")
        return [results[r] for r in range(len(self.conns))]

    def _fail(self, rank: int) -> None:
        proc = self.procs[rank]
        code = proc.poll()
        self.shutdown()
        raise WorkerDiedError(f"worker rank {rank} (pid {proc.pid}) died"
                              + (f" with exit code {code}" if code is not None else ""))

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("shutdown", (), {}))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
        for conn in self.conns:
            conn.close()
        self.conns = []
