"""Entry point of a worker process: `python -m shardserve.executor.worker_proc HOST PORT RANK`.

Connects back to the engine, receives its start-up arguments, builds a Worker and serves RPCs until
told to stop or until the engine goes away."""
from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client


def _die_with_parent() -> None:
    """Exit at once when the engine's process goes away, even if this one is stuck in a collective.

    A watchdog thread rather than PR_SET_PDEATHSIG: that signal fires when the *thread* that
    started us exits, which would kill the workers of an engine built in a worker thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def no_delay(conn):
    """Turn Nagle's algorithm off on a connection's TCP socket, and return the connection.

    With it on, a message sent while the peer has not yet acknowledged the previous one waits for
    that acknowledgement, which the peer piggybacks on its next reply. The sampling worker replies
    only when a step's tokens are ready, so the next step's message reached it a whole step late and
    the GPUs idled between steps (8B at TP=2: 3.8 ms per step instead of 3.2)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:   # same socket; closing the dup keeps it
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _connect(host: str, port: int, authkey: bytes, rank: int, timeout_s: float = 300.0):
    """Dial the engine, retrying while it starts (a headless node may come up first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return no_delay(Client((host, port), authkey=authkey))
        except (ConnectionRefusedError, OSError) as e:
            if time.monotonic() > deadline:
                raise SystemExit(f"worker rank {rank}: no engine answered at {host}:{port} within "
                                 f"{timeout_s:.0f} s ({e})")
            time.sleep(0.5)


def _error(e: BaseException) -> tuple[str, str]:
    return "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def main() -> None:
    host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the engine's to handle
    conn = _connect(host, port, bytes.fromhex(os.environ["SHARDSERVE_WORKER_AUTHKEY"]), rank,
                    float(os.environ.get("SHARDSERVE_WORKER_CONNECT_TIMEOUT_S", 300)))
    conn.send(rank)
    config, rank, local_rank, init_method, eos_token_ids, show_progress, threads = conn.recv()
    import torch
    torch.set_num_threads(threads)
    try:
        from shardserve.worker.worker import Worker
        worker = Worker(config, eos_token_ids, show_progress, rank=rank, local_rank=local_rank,
                        init_method=init_method)
        conn.send(("ok", None))
    except BaseException as e:   # start-up failures (rendezvous timeouts included) reach the engine
        conn.send(_error(e))
        return
    _serve(conn, worker)
    worker.shutdown()


def _serve(conn, worker) -> None:
    """Answer the engine's RPCs in order. A call that returns a PendingOutput (`launch`, a step) is
    answered by the reply thread once the device has its results, so the next step can arrive and
    be prepared meanwhile (async scheduling keeps two in flight)."""
    from shardserve.worker.model_runner import PendingOutput
    replies: queue.Queue = queue.Queue()

    def reply() -> None:
        while (item := replies.get()) is not None:
            try:
                message = ("ok", item.get()) if isinstance(item, PendingOutput) else item
            except BaseException as e:
                message = _error(e)
            try:
                conn.send(message)
            except OSError:   # the engine is gone
                return

    thread = threading.Thread(target=reply, name="worker-replies", daemon=True)
    thread.start()
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):   # the engine is gone
            break
        if method == "shutdown":
            break
        try:
            result = getattr(worker, method)(*args, **kwargs)
            replies.put(result if isinstance(result, PendingOutput) else ("ok", result))
        except BaseException as e:
            replies.put(_error(e))
    replies.put(None)
    thread.join(timeout=30)


if __name__ == "__main__":
    main()
