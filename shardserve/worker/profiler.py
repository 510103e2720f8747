"""torch.profiler traces of the workers' steps, started and stopped on request.

vLLM's habit: set a directory in the environment (`SHARDSERVE_TORCH_PROFILER_DIR`, or vLLM's own
`VLLM_TORCH_PROFILER_DIR`), then call `LLM.start_profile()` / `stop_profile()`, or POST
`/start_profile` and `/stop_profile` to the server (`bench serve --profile` does). Every worker
writes one gzipped Chrome trace per start/stop, named by its rank, for Perfetto or
chrome://tracing: host ops, and on a GPU the kernels (graph replays included). As in vLLM, the
traces hold Python call stacks (where host time goes; `SHARDSERVE_TORCH_PROFILER_WITH_STACK=0` or
`VLLM_TORCH_PROFILER_WITH_STACK=0` leaves them out) and, with `..._RECORD_SHAPES=1`, tensor shapes.
For developers: profiling slows every step down.
"""
from __future__ import annotations

import os
import socket
import time

import torch

ENV_NAMES = ("SHARDSERVE_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")


def _env_flag(setting: str, default: bool) -> bool:
    """SHARDSERVE_TORCH_PROFILER_<setting>, else vLLM's VLLM_TORCH_PROFILER_<setting>: "0" off, else on."""
    for prefix in ("SHARDSERVE", "VLLM"):
        value = os.environ.get(f"{prefix}_TORCH_PROFILER_{setting}")
        if value:
            return value != "0"
    return default


def profiler_dir() -> str | None:
    """The trace directory from the environment, or None when profiling is off."""
    return next((os.environ[name] for name in ENV_NAMES if os.environ.get(name)), None)


def require_profiler_dir() -> str:
    directory = profiler_dir()
    if directory is None:
        raise ValueError(f"profiling is off: set {ENV_NAMES[0]} (or {ENV_NAMES[1]}) to the directory for "
                         "the traces before starting the engine")
    return directory


class StepProfiler:
    """One worker's profiler: start(), then stop() writes the trace and returns its path."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self._profile: torch.profiler.profile | None = None
        self._directory = ""

    def start(self, directory: str) -> None:
        if self._profile is not None:
            raise RuntimeError("the profiler is already running: stop it first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(directory, exist_ok=True)
        self._directory = directory
        self._profile = torch.profiler.profile(activities=activities, with_stack=_env_flag("WITH_STACK", True),
                                               record_shapes=_env_flag("RECORD_SHAPES", False))
        self._profile.start()

    def stop(self) -> str:
        if self._profile is None:
            raise RuntimeError("the profiler is not running: start it first")
        profile, self._profile = self._profile, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the last steps' kernels belong in the trace
        profile.stop()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(self._directory, f"rank{self.rank}-{socket.gethostname()}-{os.getpid()}-{stamp}"
                                             ".pt.trace.json.gz")
        profile.export_chrome_trace(path)
        return path
