"""The doctor's checks. Each returns a `Check`: PASS / WARN / FAIL / SKIP, one line of detail and,
unless it passed, a one-line fix. Everything read from the machine goes through `System` so tests
can point it at a fake /sys, /dev, /proc and environment."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from shardserve.doctor.topology import parse_topo, topology_warnings

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
ROCE_MIN_MTU = 4200    # below this RoCE's path MTU drops to 1024 bytes; jumbo frames (9000) are advised


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class System:
    sys_root: str = "/sys"
    dev_root: str = "/dev"
    proc_root: str = "/proc"
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    which: Callable[[str], str | None] = shutil.which

    def read(self, *parts: str) -> str | None:
        try:
            with open(os.path.join(*parts), encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return None

    def listdir(self, *parts: str) -> list[str]:
        try:
            return sorted(os.listdir(os.path.join(*parts)))
        except OSError:
            return []


# ---- what the machine has -----------------------------------------------------------------------
def rdma_devices(s: System) -> list[dict[str, Any]]:
    """/sys/class/infiniband/<dev>: ports with state and link layer, and the netdevs of RoCE ports."""
    base = os.path.join(s.sys_root, "class", "infiniband")
    out = []
    for dev in s.listdir(base):
        ports = []
        for port in s.listdir(base, dev, "ports"):
            p = os.path.join(base, dev, "ports", port)
            gid_types = {i: s.read(p, "gid_attrs", "types", i) for i in s.listdir(p, "gid_attrs", "types")[:16]}
            ports.append({"port": port, "state": (s.read(p, "state") or "?").split(":")[-1].strip(),
                          "link_layer": s.read(p, "link_layer") or "?", "rate": s.read(p, "rate") or "?",
                          "gid_types": {k: v for k, v in gid_types.items() if v}})
        out.append({"name": dev, "ports": ports, "netdevs": s.listdir(base, dev, "device", "net")})
    if not out and s.which("ibv_devinfo"):
        try:
            done = subprocess.run(["ibv_devinfo"], capture_output=True, text=True, timeout=30)
            out = parse_ibv_devinfo(done.stdout)
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def parse_ibv_devinfo(text: str) -> list[dict[str, Any]]:
    """`ibv_devinfo` output -> the same device dicts as rdma_devices (used when sysfs shows none,
    as in containers that mount the verbs devices but not /sys/class/infiniband)."""
    devices: list[dict[str, Any]] = []
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "hca_id":
            devices.append({"name": value, "ports": [], "netdevs": []})
        elif key == "port" and devices:
            devices[-1]["ports"].append({"port": value, "state": "?", "link_layer": "?", "rate": "?", "gid_types": {}})
        elif devices and devices[-1]["ports"] and key in ("state", "link_layer", "active_mtu"):
            port = devices[-1]["ports"][-1]
            if key == "state":    # PORT_ACTIVE (4)
                port["state"] = value.split()[0].removeprefix("PORT_")
            else:
                port[key] = value.split()[0]
    return devices


def interfaces(s: System) -> list[str]:
    return s.listdir(s.sys_root, "class", "net")


def default_route_interface(s: System) -> str | None:
    for line in (s.read(s.proc_root, "net", "route") or "").splitlines()[1:]:
        cols = line.split()
        if len(cols) > 1 and cols[1] == "00000000":
            return cols[0]
    return None


def nccl_list_matches(spec: str, names: list[str]) -> list[str]:
    """NCCL's list syntax (NCCL_SOCKET_IFNAME, NCCL_IB_HCA): comma-separated prefixes, '=' for exact
    names, a leading '^' to exclude; ':port' suffixes name HCA ports."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    items = [i.split(":")[0] for i in spec.lstrip("=").split(",") if i]
    hit = [n for n in names if any(n == i if exact else n.startswith(i) for i in items)]
    return [n for n in names if n not in hit] if exclude else hit


# ---- checks -------------------------------------------------------------------------------------
def gpu_info() -> dict[str, Any]:
    import torch
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": [], "nccl": None,
                            "driver": None}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"index": i, "name": p.name, "memory_bytes": p.total_memory,
                                 "capability": f"{p.major}.{p.minor}"})
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:   # a build without NCCL
            pass
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        info["driver"] = (done.stdout.strip().splitlines() or [None])[0]
    return info


def check_gpus(info: dict[str, Any]) -> Check:
    gpus = info["gpus"]
    if not gpus:
        build = "a CPU-only build" if not info["cuda"] else f"built for CUDA {info['cuda']}"
        return Check("gpus", WARN, f"no CUDA GPU visible (torch {info['torch']}, {build}); CPU checks only",
                     "install the NVIDIA driver and a CUDA build of torch; `shardserve plan` works without GPUs",
                     {"count": 0})
    names = sorted({g["name"] for g in gpus})
    mem = min(g["memory_bytes"] for g in gpus) / 2**30
    return Check("gpus", PASS, f"{len(gpus)} x {', '.join(names)}, {mem:.1f} GiB each", None,
                 {"count": len(gpus), "gpus": gpus})


def check_versions(info: dict[str, Any]) -> Check:
    parts = [f"torch {info['torch']}"]
    if info["gpus"]:
        parts += [f"CUDA {info['cuda']}", f"driver {info['driver'] or '?'}", f"NCCL {info['nccl'] or '?'}"]
        if not info["nccl"]:
            return Check("versions", FAIL, ", ".join(parts),
                         "install a torch build with NCCL (the CUDA wheels have it)")
    return Check("versions", PASS, ", ".join(parts), None, {k: info[k] for k in ("torch", "cuda", "driver", "nccl")})


def check_topology(s: System, run: Callable[[list[str]], str] | None = None) -> Check:
    if not s.which("nvidia-smi"):
        return Check("topology", SKIP, "nvidia-smi not found: no NVIDIA driver here",
                     "install the NVIDIA driver to see which GPU pairs are NVLink")
    run = run or (lambda cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout)
    try:
        topo = parse_topo(run(["nvidia-smi", "topo", "-m"]))
    except (ValueError, OSError, subprocess.SubprocessError) as e:
        return Check("topology", WARN, f"could not read `nvidia-smi topo -m`: {e}", "run it by hand and look")
    data = topo.to_dict()
    if len(topo.gpus) < 2:
        return Check("topology", PASS, f"{len(topo.gpus)} GPU: no GPU-to-GPU links to check", None, data)
    counts = ", ".join(f"{n} x {code}" for code, n in sorted(data["link_counts"].items()))
    warnings = topology_warnings(topo)
    data["warnings"] = warnings
    if not warnings:
        return Check("topology", PASS, f"{len(topo.gpus)} GPUs, every pair NVLink ({counts})", None, data)
    return Check("topology", WARN, f"{len(topo.gpus)} GPUs, pairs: {counts}; {warnings[0]}",
                 "keep TP groups on NVLink-connected GPUs (CUDA_VISIBLE_DEVICES order), or use PP across slow links",
                 data)


def check_rdma(s: System, devices: list[dict[str, Any]], multi_node: bool) -> Check:
    uverbs = [d for d in s.listdir(s.dev_root, "infiniband") if d.startswith("uverbs")]
    if not devices:
        have = s.listdir(s.dev_root, "infiniband")
        detail = "no RDMA devices in /sys/class/infiniband" + (f" (/dev/infiniband has only {', '.join(have)})"
                                                             if have else "")
        fix = "needed only between nodes, where NCCL would otherwise use TCP sockets: install the NIC's RDMA " \
              "driver (rdma-core, mlx5_ib)"
        return Check("rdma", WARN if multi_node else SKIP, detail, fix, {"devices": []})
    ports = [f"{d['name']}:{p['port']} {p['state']} {p['link_layer']} {p['rate']}" for d in devices for p in d["ports"]]
    data = {"devices": devices, "uverbs": uverbs}
    if not uverbs:
        return Check("rdma", WARN, f"{'; '.join(ports)}; but no /dev/infiniband/uverbs*: verbs are not usable here",
                     "in a container pass --device /dev/infiniband (uverbs*), or load ib_uverbs", data)
    down = [p for p in ports if " ACTIVE " not in p]
    if down:
        return Check("rdma", WARN, "; ".join(ports), f"bring the port up (cable, switch, subnet manager): {down[0]}",
                     data)
    return Check("rdma", PASS, "; ".join(ports), None, data)


def check_mtu(s: System, devices: list[dict[str, Any]]) -> Check:
    names = interfaces(s)
    spec = s.environ.get("NCCL_SOCKET_IFNAME")
    chosen = (nccl_list_matches(spec, names) or [None])[0] if spec else default_route_interface(s)
    roce = sorted({n for d in devices for p in d["ports"] if p["link_layer"] == "Ethernet" for n in d["netdevs"]})
    mtus = {i: s.read(s.sys_root, "class", "net", i, "mtu") for i in ([chosen] if chosen else []) + roce}
    detail = ", ".join(f"{i} MTU {m or '?'}" + (" (RoCE)" if i in roce else " (NCCL socket interface)")
                       for i, m in mtus.items()) or "no interface found for NCCL's socket traffic"
    small = [i for i in roce if int(mtus.get(i) or 0) < ROCE_MIN_MTU]
    if small:
        return Check("mtu", WARN, detail, f"jumbo frames for RoCE: ip link set dev {small[0]} mtu 9000 "
                     "(and on the switch ports)", {"mtu": mtus})
    return Check("mtu", PASS, detail, None, {"mtu": mtus})


def check_nccl_env(s: System, devices: list[dict[str, Any]]) -> Check:
    env = {k: v for k, v in s.environ.items() if k.startswith("NCCL_")}
    problems: list[tuple[str, str, str]] = []   # (status, what, fix)
    names = interfaces(s)
    hcas = [d["name"] for d in devices]
    if "NCCL_SOCKET_IFNAME" in env and not nccl_list_matches(env["NCCL_SOCKET_IFNAME"], names):
        problems.append((FAIL, f"NCCL_SOCKET_IFNAME={env['NCCL_SOCKET_IFNAME']} matches no interface "
                         f"(have {', '.join(names)})", "set it to the interface that reaches the other nodes"))
    if "NCCL_IB_HCA" in env and not nccl_list_matches(env["NCCL_IB_HCA"], hcas):
        problems.append((FAIL, f"NCCL_IB_HCA={env['NCCL_IB_HCA']} matches no RDMA device "
                         f"(have {', '.join(hcas) or 'none'})", "list devices from `ibv_devices` (e.g. mlx5_0,mlx5_1)"))
    roce = [d for d in devices if any(p["link_layer"] == "Ethernet" for p in d["ports"])]
    if roce:
        gid = env.get("NCCL_IB_GID_INDEX")
        types = roce[0]["ports"][0]["gid_types"] if roce[0]["ports"] else {}
        if gid is None:
            problems.append((WARN, "RoCE devices but NCCL_IB_GID_INDEX is not set",
                             "set NCCL_IB_GID_INDEX to the RoCE v2 GID (show_gids lists them; often 3)"))
        elif types and "v2" not in (types.get(gid) or "").lower():
            problems.append((WARN, f"NCCL_IB_GID_INDEX={gid} is {types.get(gid) or 'an empty GID'} on "
                             f"{roce[0]['name']}, not RoCE v2", "pick the RoCE v2 GID index from show_gids"))
    if env.get("NCCL_IB_DISABLE") == "1" and devices:
        problems.append((WARN, "NCCL_IB_DISABLE=1 although RDMA devices exist", "unset NCCL_IB_DISABLE"))
    if env.get("NCCL_P2P_DISABLE") == "1":
        problems.append((WARN, "NCCL_P2P_DISABLE=1: GPU pairs go through host memory", "unset NCCL_P2P_DISABLE"))
    data = {"env": env}
    if not problems:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(env.items())) or "no NCCL_* variables set (NCCL's defaults)"
        return Check("nccl-env", PASS, shown, None, data)
    worst = FAIL if any(p[0] == FAIL for p in problems) else WARN
    first = next(p for p in problems if p[0] == worst)
    return Check("nccl-env", worst, "; ".join(p[1] for p in problems), first[2], data)
