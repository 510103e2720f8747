"""`shardserve doctor`: run the checks, the all-reduce benchmarks and NCCL transport detection,
print a table, and write the JSON (with the profile `shardserve plan --profile` reads)."""
from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict
from typing import Any

from shardserve.doctor import allreduce
from shardserve.doctor.checks import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    Check,
    System,
    check_gpus,
    check_mtu,
    check_nccl_env,
    check_rdma,
    check_topology,
    check_versions,
    gpu_info,
    rdma_devices,
)
from shardserve.doctor.topology import parse_nccl_log


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _points_line(result: dict[str, Any]) -> str:
    return ", ".join(f"{_size(p['bytes'])} {p['seconds'] * 1e6:,.0f} us ({p['busbw'] / 1e9:.2f} GB/s)"
                     for p in result["points"])


def check_allreduce(name: str, run: dict[str, Any], where: str) -> Check:
    if run["error"] or not run["result"]:
        return Check(name, FAIL, f"all-reduce {where} failed: {run['error']}",
                     "run with NCCL_DEBUG=INFO and look at the last lines; check firewalls and the rendezvous port")
    r = run["result"]
    return Check(name, PASS, f"{r['backend']}, {r['world']} ranks {where}: {_points_line(r)}", None, r)


def check_transport(nccl: dict[str, Any], all_nvlink: bool | None) -> Check:
    if not nccl["channels"]:
        return Check("transport", WARN, "NCCL printed no `Channel ... via` lines", "rerun with NCCL_DEBUG=INFO "
                     "and without NCCL_DEBUG_SUBSYS / NCCL_DEBUG_FILE overrides", nccl)
    seen = ", ".join(nccl["transports"]) + (f" ({nccl['net']})" if nccl["net"] else "")
    if nccl["socket_fallback"]:
        return Check("transport", FAIL, f"NCCL {nccl['version']}: cross-node traffic fell back to NET/Socket (TCP)",
                     "RDMA is not in use: check /dev/infiniband/uverbs*, NCCL_IB_HCA, NCCL_IB_DISABLE, the rdma check",
                     nccl)
    if "NET" in nccl["transports"] and not nccl["gdrdma"]:
        return Check("transport", WARN, f"NCCL {nccl['version']}: {seen}, RDMA without GPUDirect (staged through "
                     "host memory)", "load nvidia-peermem (or use DMA-BUF) and set NCCL_NET_GDR_LEVEL=PHB", nccl)
    if "SHM" in nccl["transports"]:
        return Check("transport", WARN, f"NCCL {nccl['version']}: {seen}: GPUs talk through host shared memory",
                     "unset NCCL_P2P_DISABLE; check IOMMU/ACS settings that block PCIe peer-to-peer", nccl)
    link = " over NVLink" if all_nvlink and "P2P" in nccl["transports"] else ""
    return Check("transport", PASS, f"NCCL {nccl['version']}: {seen}{link}" + (", GPUDirect RDMA" if nccl["gdrdma"]
                                                                           else ""), None, nccl)


def parse_peers(spec: str) -> list[tuple[str, int]]:
    peers = []
    for item in spec.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--peers entry {item!r} is not host:port")
        peers.append((host, int(port)))
    if len(peers) < 2:
        raise ValueError("--peers needs at least two host:port entries (this node among them)")
    return peers


def find_node_rank(peers: list[tuple[str, int]]) -> int:
    """The peer whose address this machine can bind to is this node."""
    mine = []
    for i, (host, _) in enumerate(peers):
        try:
            with socket.socket() as s:
                s.bind((socket.gethostbyname(host), 0))
            mine.append(i)
        except OSError:
            continue
    if len(mine) != 1:
        raise ValueError(f"cannot tell which --peers entry is this node ({len(mine)} match its addresses): "
                         "pass --node-rank")
    return mine[0]


def _link_profile(result: dict[str, Any], where: str) -> dict[str, Any]:
    from shardserve.planner.hardware import fit_alpha_beta
    lat, bw = fit_alpha_beta([(p["bytes"], p["seconds"]) for p in result["points"]], result["world"])
    return {"latency_s": lat, "bandwidth": bw, "world": result["world"], "backend": result["backend"],
            "source": f"{result['backend']}, {result['world']} ranks {where} (doctor)", "points": result["points"]}


def format_report(host: str, checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"shardserve doctor on {host}"]
    for c in checks:
        lines.append(f"  {c.status:4}  {c.name.ljust(width)}  {c.detail}")
        if c.fix and c.status != PASS:
            lines.append(f"        {' ' * width}  fix: {c.fix}")
    return "\n".join(lines)


def _record_allreduce(check: str, key: str, link: str, run: dict[str, Any], where: str, nccl: bool,
                      all_nvlink: bool | None, checks: list[Check], report: dict[str, Any],
                      profile: dict[str, Any]) -> None:
    """One all-reduce run (local or across --peers): its check, its result and fitted link in the
    report and profile, and on GPUs the transport NCCL used, read from its INFO log."""
    checks.append(check_allreduce(check, run, where))
    if run["result"]:
        report[key] = run["result"]
        profile["links"][link] = _link_profile(run["result"], where)
    if nccl:
        report[f"nccl_{key}"] = parse_nccl_log(run["log"])
        checks.append(check_transport(report[f"nccl_{key}"], all_nvlink))


def run_doctor(json_path: str | None = None, peers: str | None = None, node_rank: int | None = None,
               timeout: float = 60.0, system: System | None = None, info: dict[str, Any] | None = None) -> int:
    s, host = system or System(), socket.gethostname()
    peer_list = parse_peers(peers) if peers else []
    if peer_list:
        node_rank = find_node_rank(peer_list) if node_rank is None else node_rank
        if not 0 <= node_rank < len(peer_list):
            raise ValueError(f"--node-rank {node_rank} is outside the {len(peer_list)} --peers")
    info = info or gpu_info()
    devices = rdma_devices(s)
    checks = [check_gpus(info), check_versions(info), check_topology(s), check_rdma(s, devices, bool(peer_list)),
              check_mtu(s, devices), check_nccl_env(s, devices)]
    topo = next(c for c in checks if c.name == "topology").data
    ngpu = len(info["gpus"])
    profile: dict[str, Any] = {"links": {}, "gpu": info["gpus"][0] if ngpu else None, "hbm_bandwidth": None}
    report: dict[str, Any] = {}
    if ngpu:
        import torch

        from shardserve.bench.offline import measure_bandwidth
        profile["hbm_bandwidth"] = measure_bandwidth(torch.device("cuda", 0))
        torch.cuda.empty_cache()          # leave GPU 0's memory to the benchmark ranks
        checks.append(Check("hbm", PASS, f"cuda:0 device-to-device copy {profile['hbm_bandwidth'] / 1e12:.2f} TB/s"))
    else:
        checks.append(Check("hbm", SKIP, "no GPU: HBM bandwidth not measured"))
    if ngpu == 1:
        checks.append(Check("allreduce", SKIP, "one GPU: nothing to all-reduce with"))
    else:
        where = f"on {ngpu} local GPUs" if ngpu else "as 2 CPU processes on loopback"
        run = allreduce.run_local("cuda" if ngpu else "cpu", ngpu or 2, timeout, nccl_debug=bool(ngpu))
        _record_allreduce("allreduce", "local", "intra_node", run, where, bool(ngpu), topo.get("all_nvlink"),
                          checks, report, profile)
    if not ngpu or ngpu == 1:
        checks.append(Check("transport", SKIP, "NCCL transport detection needs 2 or more GPUs"))
    if peer_list:
        h0, p0 = peer_list[0]
        where = f"across {len(peer_list)} nodes (this is node {node_rank})"
        run = allreduce.run_ranks([node_rank], len(peer_list), f"tcp://{h0}:{p0}", "cuda" if ngpu else "cpu",
                                  allreduce.GPU_SIZES if ngpu else allreduce.CPU_SIZES, timeout,
                                  {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV"} if ngpu else None)
        _record_allreduce("peers", "peers", "inter_node", run, where, bool(ngpu), None, checks, report, profile)
    else:
        checks.append(Check("peers", SKIP, "no --peers: cross-node all-reduce not run"))
    print(format_report(host, checks))
    if json_path:
        doc = {"host": host, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "checks": [asdict(c) for c in checks],
               "allreduce": report, "profile": profile}
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {json_path} (use it with: shardserve plan MODEL --profile {json_path})")
    return 1 if any(c.status == FAIL for c in checks) else 0


__all__ = ["run_doctor", "PASS", "WARN", "FAIL", "SKIP"]
