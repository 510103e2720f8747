"""`shardserve plan ... --emit k8s DIR`: Kubernetes manifests for the plan's recommended layout.

One replica fits a node: a Deployment (replicas = DP) of `shardserve serve -tp T -pp P`. It spans
nodes: a LeaderWorkerSet (replicas = DP, size = nodes per replica) whose leader runs `serve` and
whose workers run `shardserve worker`, placed by the LWS env (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE,
LWS_WORKER_INDEX). Beside it: a Service, a PodMonitor on /metrics, a model-cache PVC, the cluster-key
Secret (multi-node), and the router (ConfigMap with a fusion panel, Deployment, Service).
The serve flags carry the plan's memory settings (--max-model-len, --gpu-memory-utilization,
--kv-cache-dtype, --quantization), so what plan predicts is what runs (docs/deploy.md).
"""
from __future__ import annotations

import os
import secrets
from typing import Any

DEFAULT_IMAGE = "shardserve:cuda"
PORT = 8000
MASTER_PORT = 29500
ROUTER_PORT = 9000
SHUTDOWN_TIMEOUT_S = 60
CACHE_DIR = "/cache"
LABELS = {"app.kubernetes.io/part-of": "shardserve"}
# NCCL over RDMA between the nodes of a group; the interface and GID index depend on the fabric.
NCCL_ENV = {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "0", "NCCL_IB_GID_INDEX": "3",
            "NCCL_NET_GDR_LEVEL": "PHB"}


def layout(plan: dict[str, Any]) -> dict[str, Any]:
    """The recommended row as deployment units: GPUs per pod, pods per replica, replicas."""
    rec = plan.get("recommended")
    if not rec:
        raise ValueError("the plan recommends no layout (nothing fits); nothing to emit")
    per_node = plan["settings"]["gpus_per_node"]
    tp, pp, dp = rec["tp"], rec["pp"], rec["dp"]
    ep = bool(rec.get("expert_parallel"))
    in_pod_dp = dp if ep and dp > 1 else 1   # experts spanning replicas: one engine with -dp
    ranks = tp * pp * in_pod_dp
    nodes = -(-ranks // per_node)
    if ranks % nodes:
        raise ValueError(f"TP={tp} x PP={pp} ranks do not split evenly over {nodes} nodes of {per_node} GPUs")
    return {"tp": tp, "pp": pp, "dp": in_pod_dp, "ep": ep, "replicas": dp // in_pod_dp, "nodes": nodes,
            "gpus_per_pod": ranks // nodes}


def serve_args(plan: dict[str, Any], model: str, lay: dict[str, Any]) -> list[str]:
    s = plan["settings"]
    args = ["--model", model, "-tp", str(lay["tp"]), "-pp", str(lay["pp"])]
    if lay["dp"] > 1:
        args += ["-dp", str(lay["dp"])]
    if lay["ep"]:
        args.append("--enable-expert-parallel")
    args += ["--max-model-len", str(s["max_model_len"]), "--gpu-memory-utilization", str(s["gpu_memory_utilization"])]
    if s["dtype"] == "fp8":
        args += ["--quantization", "fp8"]   # int4 comes from a GPTQ/AWQ checkpoint itself
    if s["kv_cache_dtype"].startswith("fp8"):
        args += ["--kv-cache-dtype", "fp8"]
    return args


def engine_env(plan: dict[str, Any]) -> dict[str, str]:
    """Environment the pods need to hold the model as planned: FP4 planned at 4.5 bits a weight runs
    only where SHARDSERVE_FP4_KERNELS=1 keeps it 4-bit (quantization/stored.fp4_kept_on_gpus)."""
    return {"SHARDSERVE_FP4_KERNELS": "1"} if plan["settings"]["dtype"] == "fp4" else {}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


def _container(name: str, image: str, args: list[str], gpus: int, serve: bool, env: dict[str, Any]) -> dict:
    c: dict[str, Any] = {
        "name": name, "image": image, "args": args,
        "env": [{"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"}, *({"name": k, **v} if isinstance(v, dict)
                                                                            else {"name": k, "value": v}
                                                                            for k, v in env.items())],
        "resources": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus, "cpu": 4 * gpus,
                                                                       "memory": f"{32 * gpus}Gi"}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "model-cache", "mountPath": CACHE_DIR}],
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True},
    }
    if not serve:   # the image's entry point is `shardserve serve`
        c["command"] = ["shardserve"]
    if serve:
        c["ports"] = [{"name": "http", "containerPort": PORT}]
        # Loading a large model takes long: the startup probe allows an hour before liveness counts.
        c["startupProbe"] = _probe("/health", 10, 360)
        c["readinessProbe"] = _probe("/health", 5, 1)    # 503 while draining: out of the Service at once
        c["livenessProbe"] = _probe("/ping", 10, 6)      # stays 200 while draining
        c["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", "5"]}}}   # endpoints update first
    return c


def _pod_spec(containers: list[dict], gpus: int, rdma: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": SHUTDOWN_TIMEOUT_S + 30,
        "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
        "containers": containers,
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{max(8, 4 * gpus)}Gi"}},
                    {"name": "model-cache", "persistentVolumeClaim": {"claimName": "shardserve-model-cache"}}],
    }
    if rdma:   # RDMA needs locked memory; the RDMA device resource name depends on the cluster's plugin
        for c in containers:
            c["securityContext"]["capabilities"] = {"add": ["IPC_LOCK"]}
    return spec


def _meta(name: str, component: str) -> dict[str, Any]:
    return {"name": name, "labels": {**LABELS, "app.kubernetes.io/name": name,
                                     "app.kubernetes.io/component": component}}


def manifests(plan: dict[str, Any], model: str, image: str = DEFAULT_IMAGE, name: str = "shardserve",
              cluster_key: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """File name -> the Kubernetes objects it holds."""
    lay = layout(plan)
    args = serve_args(plan, model, lay) + ["--served-model-name", model, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    gpus = lay["gpus_per_pod"]
    select = {"app.kubernetes.io/name": name}
    out: dict[str, list[dict[str, Any]]] = {}
    out["model-cache.yaml"] = [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                "metadata": _meta("shardserve-model-cache", "cache"),
                                "spec": {"accessModes": ["ReadWriteMany"],
                                         "resources": {"requests": {"storage": "1Ti"}}}}]
    if lay["nodes"] == 1:
        pod = _pod_spec([_container("shardserve", image, args, gpus, True, engine_env(plan))], gpus, rdma=False)
        out["deployment.yaml"] = [{
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, "server"),
            "spec": {"replicas": lay["replicas"], "selector": {"matchLabels": select},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": {"metadata": {"labels": {**LABELS, **select}}, "spec": pod}}}]
    else:
        key_env = {"SHARDSERVE_CLUSTER_KEY": {"valueFrom": {"secretKeyRef": {"name": f"{name}-cluster-key",
                                                                             "key": "key"}}}, **NCCL_ENV,
                   **engine_env(plan)}
        port = ["--master-port", str(MASTER_PORT)]
        leader = _pod_spec([_container("leader", image, args + port, gpus, True, key_env)], gpus, rdma=True)
        worker = _pod_spec([_container("worker", image, ["worker", "-tp", str(lay["tp"]), "-pp", str(lay["pp"]),
                                                         *port], gpus, False, key_env)], gpus, rdma=True)
        labels = {"metadata": {"labels": {**LABELS, **select}}}
        out["secret.yaml"] = [{"apiVersion": "v1", "kind": "Secret", "metadata": _meta(f"{name}-cluster-key", "server"),
                               "type": "Opaque", "stringData": {"key": cluster_key or secrets.token_hex(32)}}]
        out["leaderworkerset.yaml"] = [{
            "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": _meta(name, "server"),
            "spec": {"replicas": lay["replicas"], "startupPolicy": "LeaderCreated",
                     "rolloutStrategy": {"type": "RollingUpdate",
                                         "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}},
                     "leaderWorkerTemplate": {"size": lay["nodes"], "restartPolicy": "RecreateGroupOnPodRestart",
                                              "leaderTemplate": {**labels, "spec": leader},
                                              "workerTemplate": {**labels, "spec": worker}}}}]
        # Only leaders serve HTTP: the Service selects the LWS leader role.
        select = {**select, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    out["service.yaml"] = [{"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, "server"),
                            "spec": {"selector": select, "ports": [{"name": "http", "port": PORT,
                                                                    "targetPort": "http"}]}}]
    out["podmonitor.yaml"] = [{"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
                               "metadata": _meta(name, "server"),
                               "spec": {"selector": {"matchLabels": select},
                                        "podMetricsEndpoints": [{"port": "http", "path": "/metrics",
                                                                 "interval": "15s"}]}}]
    out["router.yaml"] = router_manifests(f"http://{name}:{PORT}/v1", model, image)
    return out


def router_config(base_url: str, model: str) -> dict[str, Any]:
    """A fusion panel of two sampling settings of the served model, judged by the same model."""
    backends = [{"id": bid, "type": "shardserve", "base_url": base_url, "model": model, "timeout_s": 300}
                for bid in ("main", "main-creative")]
    return {"backends": backends, "default_model": "main", "decisions": [
        {"id": "fusion", "priority": 10, "algorithm": {
            "type": "fusion", "analysis_models": ["main", "main-creative"], "judge_model": "main",
            "on_error": "skip", "min_successful_responses": 1, "round_timeout_seconds": 120,
            "analysis_overrides": {"main-creative": {"temperature": 0.9}}}}]}


def router_manifests(base_url: str, model: str, image: str) -> list[dict[str, Any]]:
    import yaml
    select = {"app.kubernetes.io/name": "shardserve-router"}
    container = {
        "name": "router", "image": image, "command": ["shardserve"],
        "args": ["router", "--config", "/etc/shardserve/router.yaml", "--host", "0.0.0.0", "--port", str(ROUTER_PORT)],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        "readinessProbe": _probe("/health", 5, 2), "livenessProbe": _probe("/health", 10, 6),
        "resources": {"requests": {"cpu": 1, "memory": "1Gi"}},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/shardserve"}],
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True}}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta("shardserve-router", "router"),
         "data": {"router.yaml": yaml.safe_dump(router_config(base_url, model), sort_keys=False)}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta("shardserve-router", "router"),
         "spec": {"replicas": 1, "selector": {"matchLabels": select},
                  "template": {"metadata": {"labels": {**LABELS, **select}},
                               "spec": {"securityContext": {"runAsUser": 1000, "runAsGroup": 1000},
                                        "containers": [container],
                                        "volumes": [{"name": "config",
                                                     "configMap": {"name": "shardserve-router"}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta("shardserve-router", "router"),
         "spec": {"selector": select, "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": "http"}]}}]


def write_manifests(directory: str, files: dict[str, list[dict[str, Any]]], header: str = "") -> list[str]:
    import yaml

    class Dumper(yaml.SafeDumper):   # shared sub-dicts written out in full, not as YAML anchors
        def ignore_aliases(self, data: Any) -> bool:
            return True
    os.makedirs(directory, exist_ok=True)
    paths = []
    for fname, docs in files.items():
        path = os.path.join(directory, fname)
        with open(path, "w", encoding="utf-8") as f:
            f.write(header + "---\n".join(yaml.dump(d, Dumper=Dumper, sort_keys=False) for d in docs))
        paths.append(path)
    return paths


def emit(plan: dict[str, Any], target: list[str], model: str, image: str = DEFAULT_IMAGE) -> list[str]:
    """`--emit k8s DIR`: write the manifests and say where (to stderr, so --json output stays JSON)."""
    import sys
    kind, directory = target
    if kind != "k8s":
        raise ValueError(f"--emit {kind!r}: the only format is k8s")
    lay = layout(plan)
    header = (f"# shardserve plan {plan['model']['name']}: TP={lay['tp']} PP={lay['pp']} x {lay['replicas']} "
              f"replicas, {lay['nodes']} node(s) of {lay['gpus_per_pod']} GPUs each (docs/deploy.md)\n")
    paths = write_manifests(directory, manifests(plan, model, image), header)
    print(f"wrote {', '.join(paths)}", file=sys.stderr)
    return paths
