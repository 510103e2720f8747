"""deploy/k8s/ and `plan --emit k8s` output: core objects valid against the Kubernetes 1.37 schema
(kubernetes-validate, offline, strict); the LeaderWorkerSet's leader and worker pod templates
validated as core PodTemplates; the CRDs' own fields (LeaderWorkerSet, PodMonitor) checked against the
fields this repo uses (not the upstream CRD schema, which is not bundled); the router ConfigMap parsed
by the router's own loader; every probe path answered by a live `shardserve serve`."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import kubernetes_validate  # the test extra: a missing one must fail, not skip
import pytest
import yaml

from shardserve.router.config import parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S_VERSION = "1.37.0"
CRD_KINDS = {"LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1", "PodMonitor": "monitoring.coreos.com/v1"}


def _docs(directory: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.yaml"))):
        with open(path) as f:
            out += [d for d in yaml.safe_load_all(f) if d]
    return out


def _validate(doc: dict) -> None:
    if doc["kind"] in CRD_KINDS:
        assert doc["apiVersion"] == CRD_KINDS[doc["kind"]]
        if doc["kind"] == "LeaderWorkerSet":
            spec = doc["spec"]
            allowed = {"replicas", "startupPolicy", "rolloutStrategy", "leaderWorkerTemplate", "networkConfig"}
            assert set(spec) <= allowed
            lwt = spec["leaderWorkerTemplate"]
            assert lwt["restartPolicy"] in ("RecreateGroupOnPodRestart", "None") and lwt["size"] >= 2
            for role in ("leaderTemplate", "workerTemplate"):
                template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role},
                            "template": lwt[role]}
                kubernetes_validate.validate(template, K8S_VERSION, strict=True)
        else:
            assert set(doc["spec"]) == {"selector", "podMetricsEndpoints"}
            assert doc["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    if doc["kind"] == "ConfigMap" and "router.yaml" in doc["data"]:
        parse_config(yaml.safe_load(doc["data"]["router.yaml"]))


def _probe_paths(docs: list[dict]) -> set[str]:
    paths = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k.endswith("Probe"):
                    paths.add(v["httpGet"]["path"])
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(docs)
    return paths


@pytest.mark.parametrize("example", ["single-node", "multi-node"])
def test_deploy_manifests_validate(example):
    docs = _docs(os.path.join(ROOT, "deploy", "k8s", example))
    kinds = {d["kind"] for d in docs}
    assert {"Service", "PodMonitor", "ConfigMap", "PersistentVolumeClaim"} <= kinds
    assert ("Deployment" in kinds) and (("LeaderWorkerSet" in kinds) == (example == "multi-node"))
    for doc in docs:
        _validate(doc)
    assert _probe_paths(docs) == {"/health", "/ping"}


@pytest.mark.parametrize("argv, kind, flags", [
    (["llama-3.1-8b", "--gpus-per-node", "2", "--max-model-len", "8192"], "Deployment", ["--max-model-len", "8192"]),
    (["llama-3.1-405b", "--nodes", "2", "--max-model-len", "32768", "--kv-cache-dtype", "fp8"], "LeaderWorkerSet",
     ["-tp", "8", "-pp", "2", "--kv-cache-dtype", "fp8", "--master-port", "29500"]),
    (["llama-3.1-70b", "--dtype", "fp8", "--gpus-per-node", "4", "--max-model-len", "16384"], "Deployment",
     ["--quantization", "fp8"]),
    (["llama-3.1-70b", "--dtype", "fp4", "--gpus-per-node", "2", "--max-model-len", "8192"], "Deployment", []),
])
def test_plan_emit_k8s_writes_manifests_that_validate(tmp_path, argv, kind, flags):
    out = tmp_path / "k8s"
    run = subprocess.run([sys.executable, "-m", "shardserve.cli", "plan", *argv, "--json", "--emit", "k8s", str(out),
                          "--emit-model", "org/model"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    plan = yaml.safe_load(run.stdout)["recommended"]   # --json output stays JSON
    docs = _docs(str(out))
    for doc in docs:
        _validate(doc)
    server = next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == "shardserve")
    pod = server["spec"]["leaderWorkerTemplate"]["leaderTemplate"] if kind == "LeaderWorkerSet" \
        else server["spec"]["template"]
    args = pod["spec"]["containers"][0]["args"]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert (env.get("SHARDSERVE_FP4_KERNELS") == "1") == ("fp4" in argv)   # FP4 planned 4-bit runs 4-bit
    for i in range(0, len(flags), 2):
        assert args[args.index(flags[i]) + 1] == flags[i + 1]
    assert args[args.index("-tp") + 1] == str(plan["tp"]) and args[args.index("--model") + 1] == "org/model"
    gpus = pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    nodes = server["spec"]["leaderWorkerTemplate"]["size"] if kind == "LeaderWorkerSet" else 1
    assert gpus * nodes == plan["tp"] * plan["pp"] * (1 if kind == "LeaderWorkerSet" else 1)


def test_probe_paths_answer_on_a_live_server(tmp_path):
    from tests.server.server_process import ServerProcess, get
    from tests.tiny_models import make_tiny_checkpoint
    paths = _probe_paths(_docs(os.path.join(ROOT, "deploy", "k8s", "single-node")))
    paths |= {"/metrics"}   # the PodMonitor's path
    srv = ServerProcess([make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama"), "--kv-cache-memory", "16MiB"],
                        str(tmp_path / "s.log"))
    try:
        for path in sorted(paths):
            status, body, _ = get(srv.url + path)
            assert status == 200, path
        assert b"vllm:" in get(srv.url + "/metrics")[1]
    finally:
        assert srv.stop() == 0
