"""A dying worker is a prompt, rank-naming error with nothing left running; SmolLM2 shards over TP=3."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from shardserve import LLM, SamplingParams
from shardserve.executor.base import WorkerDiedError
from tests.tiny_models import make_tiny_checkpoint


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_killed_worker_names_its_rank_and_leaves_nothing(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=2)
    pids = [p.pid for p in llm.engine.executor.procs.values()]
    victim = pids[1]
    threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=f"worker rank 1 \\(pid {victim}\\) died"):
        # Long enough that the kill lands mid-generation.
        llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True),
                     use_tqdm=False)
    assert time.monotonic() - start < 15
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "worker processes survived the failure"
    with pytest.raises(RuntimeError, match="stopped"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.fixture(scope="module")
def smollm2_reference():
    llm = LLM(kv_cache_memory="256MiB", max_model_len=1024, show_progress=False, dtype="float32")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    try:
        return prompts, [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)]
    finally:
        llm.engine.shutdown()


def test_smollm2_tp3_matches_single_device(smollm2_reference):
    prompts, reference = smollm2_reference
    llm = LLM(kv_cache_memory="256MiB", max_model_len=1024, show_progress=False, dtype="float32",
              tensor_parallel_size=3)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16),
                                                             use_tqdm=False)]
        shapes = llm.engine.executor.collective_rpc("weight_shapes")
    finally:
        llm.engine.shutdown()
    assert got == reference
    # 9 query heads and 3 KV heads of 64: each rank holds 3 + 2 x 1 heads of the fused QKV, 320 rows
    # of 576 values kept as Q4_1 blocks in groups of 8 rows (quantization/gguf.py, the default).
    assert all(s["model.layers.0.self_attn.qkv_proj.weight"] == (5 * 64 // 8, 576 // 32, 8 * 20) for s in shapes)


def test_smollm2_tp2_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide .*9 attention heads.*"
                                         r"sizes that work: 1, 3"):
        LLM(kv_cache_memory="256MiB", show_progress=False, tensor_parallel_size=2)


def test_nccl_settings_reach_every_worker(tmp_path, monkeypatch):
    settings = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_HCA": "mlx5_0", "NCCL_IB_GID_INDEX": "3",
                "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_DEBUG": "INFO"}
    for k, v in settings.items():
        monkeypatch.setenv(k, v)
    path = make_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=2)
    try:
        assert llm.engine.executor.collective_rpc("environment", (list(settings),)) == [settings, settings]
    finally:
        llm.engine.shutdown()


def test_interrupted_engine_leaves_no_workers(tmp_path):
    """Ctrl-C in a user's script: the script dies, and its worker processes die with it."""
    import subprocess
    import sys
    path = make_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    script = (
        "from shardserve import LLM, SamplingParams\n"
        f"llm = LLM({path!r}, kv_cache_memory='16MiB', show_progress=False, tensor_parallel_size=2)\n"
        "print(' '.join(str(p.pid) for p in llm.engine.executor.procs.values()), flush=True)\n"
        "llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=10**6, ignore_eos=True), use_tqdm=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "workers outlived the interrupted engine"


def test_engine_built_in_a_thread_keeps_its_workers(tmp_path):
    """Servers build engines off the main thread; the workers must outlive that thread."""
    path = make_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("llm", LLM(path, kv_cache_memory="16MiB",
                                                                   show_progress=False, tensor_parallel_size=2)))
    t.start()
    t.join()
    llm = box["llm"]
    try:
        time.sleep(1.5)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.shutdown()
