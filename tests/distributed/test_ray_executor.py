"""The Ray executor on a real two-node Ray cluster started on loopback (a head and a second node)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import ray  # a test dependency (pyproject's test extra): missing Ray fails, never skips

from shardserve import LLM, SamplingParams
from shardserve.executor.base import WorkerDiedError
from shardserve.executor.multiproc import free_port
from tests.tiny_models import make_tiny_checkpoint

PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 200, 100, 42] * 3, list(range(1, 10))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _ray_cli() -> list[str]:
    exe = shutil.which("ray", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "ray.scripts.scripts"]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus", "1", "--disable-usage-stats"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    subprocess.run(_ray_cli() + ["start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                                 "--include-dashboard", "false"] + common, check=True, env=env, capture_output=True)
    try:
        subprocess.run(_ray_cli() + ["start", "--address", address, "--node-ip-address", "127.0.0.1"] + common,
                       check=True, env=env, capture_output=True)
        ray.init(address=address, log_to_driver=False)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        yield address
    finally:
        ray.shutdown()
        subprocess.run(_ray_cli() + ["stop", "--force"], env=env, capture_output=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_ray")), "llama")


def test_ray_tp2_across_two_nodes_matches_single_device(ray_cluster, tiny):
    single = LLM(tiny, kv_cache_memory="16MiB", show_progress=False)
    reference = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # One CPU per node: the placement group must put one rank on each node.
    llm = LLM(tiny, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
        executor = llm.engine.executor
        placed_on = set(ray.util.placement_group_table(executor.pg)["bundles_to_node_id"].values())
        assert len(placed_on) == 2   # one rank on each Ray node
        # A dead actor is a rank-naming error, not a hang.
        ray.kill(executor.actors[1])
        with pytest.raises(WorkerDiedError, match="worker rank 1"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()
