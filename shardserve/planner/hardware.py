"""Accelerators and links the planner knows, and calibration from a `shardserve doctor --json` profile.

Numbers are *effective* ones (what a decode step or an all-reduce actually gets), not spec-sheet
peaks, where we have measurements; the rest are spec values scaled by the same efficiency and
say so. `doctor --json` + `plan --profile` replaces them with what a machine really does."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

GiB = 1024**3


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int        # nominal HBM (the "80GB" of an H100 is 80 GiB of HBM3)
    hbm_bandwidth: float     # bytes/s a large device-to-device copy gets: the decode roofline's denominator
    hbm_spec: float          # bytes/s on the spec sheet
    bf16_flops: float        # dense bf16 tensor-core peak, FLOP/s
    host_link: str           # the PCIe link to the CPU, used by the offload baseline
    peer_link: str = "nvlink"  # GPU to GPU inside a node when --interconnect does not say


# H100 and H200 bandwidths were measured with a 2 GiB copy (benchmarks/BENCHMARKS.md: 3.00 TB/s on
# an H100 SXM, 4.27 TB/s on an H200); both are ~0.9 of the spec, so the others get spec x 0.9.
GPUS: dict[str, GPU] = {g.name: g for g in [
    GPU("h100-80gb", 80 * GiB, 3.00e12, 3.35e12, 989e12, "pcie5"),
    GPU("h200-141gb", 141 * GiB, 4.27e12, 4.8e12, 989e12, "pcie5"),
    GPU("a100-80gb", 80 * GiB, 0.9 * 2.039e12, 2.039e12, 312e12, "pcie4"),
    GPU("a100-40gb", 40 * GiB, 0.9 * 1.555e12, 1.555e12, 312e12, "pcie4"),
    GPU("l40s-48gb", 48 * GiB, 0.9 * 864e9, 864e9, 362e12, "pcie4", "pcie4"),        # no NVLink
    GPU("rtx4090-24gb", 24 * GiB, 0.9 * 1008e9, 1008e9, 165e12, "pcie4", "pcie4"),   # no NVLink, no P2P
    # MI300X's Infinity Fabric mesh plays NVLink's part; the nvlink entry stands in for it.
    GPU("mi300x-192gb", 192 * GiB, 0.9 * 5.3e12, 5.3e12, 1307e12, "pcie5"),
]}


@dataclass(frozen=True)
class Link:
    name: str
    latency_s: float         # alpha: one small all-reduce as the host sees it (launch + protocol + wire)
    bandwidth: float         # beta: bytes/s per direction the collective achieves on large messages
    scope: str               # "node": GPU to GPU inside a node; "network": between nodes
    source: str = "built-in"


# A real capture on 2x H200 (NV18), bf16 all-reduce from Python: (bytes, seconds).
H200X2_NVLINK_ALLREDUCE = [(8 * 1024, 39e-6), (1 << 20, 66e-6), (16 << 20, 78e-6), (256 << 20, 895e-6)]
# The same pair forced through NCCL's TCP socket transport on loopback.
H200X2_SOCKET_ALLREDUCE = [(1 << 20, 443e-6), (256 << 20, 79e-3)]


def fit_alpha_beta(points: list[tuple[int, float]], world: int = 2) -> tuple[float, float]:
    """(latency, bandwidth) of t(m) = alpha + 2(n-1)/n * m / beta through the smallest and the
    largest message: exact at both ends, which is where decode (small) and prefill (large) live."""
    pts = sorted(points)
    (m0, t0), (m1, t1) = pts[0], pts[-1]
    ring = 2 * (world - 1) / world
    if m1 == m0 or t1 <= t0:
        return t0, float("inf")
    beta = ring * (m1 - m0) / (t1 - t0)
    return max(t0 - ring * m0 / beta, 0.0), beta


_nv_lat, _nv_bw = fit_alpha_beta(H200X2_NVLINK_ALLREDUCE)
_sock_lat, _ = fit_alpha_beta(H200X2_SOCKET_ALLREDUCE)
# PCIe and network latencies are estimates: the NVLink capture's from-Python floor (~39 us) plus a
# few microseconds of switch/NIC hops; bandwidths are line rate x 0.75 (PCIe P2P) or x 0.9 (RDMA).
LINKS: dict[str, Link] = {l.name: l for l in [
    Link("nvlink", _nv_lat, _nv_bw, "node", "fit of the 2x H200 NV18 capture"),
    Link("pcie4", 45e-6, 0.75 * 32e9, "node"),
    Link("pcie5", 45e-6, 0.75 * 64e9, "node"),
    Link("ib-ndr", 45e-6, 0.9 * 50e9, "network"),
    Link("roce-100g", 50e-6, 0.9 * 12.5e9, "network"),
    Link("roce-400g", 50e-6, 0.9 * 50e9, "network"),
    # NCCL's socket transport costs ~135 us per call even on loopback (the H200 capture).
    Link("tcp-10g", _sock_lat + 15e-6, 0.9 * 1.25e9, "network"),
    Link("tcp-1g", _sock_lat + 50e-6, 0.9 * 0.125e9, "network"),
]}


def allreduce_seconds(nbytes: float, world: int, link: Link) -> float:
    """Ring all-reduce: each rank sends and receives 2(n-1)/n of the message."""
    if world <= 1:
        return 0.0
    return link.latency_s + 2 * (world - 1) / world * nbytes / link.bandwidth


def gather_seconds(nbytes: float, world: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of a `nbytes` result: each rank sends and receives
    (n-1)/n of it, half an all-reduce's traffic, for the same one-call latency."""
    if world <= 1:
        return 0.0
    return link.latency_s + (world - 1) / world * nbytes / link.bandwidth


def p2p_seconds(nbytes: float, link: Link) -> float:
    return link.latency_s + nbytes / link.bandwidth


def pick_gpu(name: str | None, memory_bytes: int | None) -> GPU:
    """--gpu and/or --gpu-memory: a table entry, optionally with another memory size (a custom
    device keeps the named GPU's speeds, an H100's if none is named)."""
    if name is not None and name not in GPUS:
        raise ValueError(f"--gpu {name!r} is not known; choose one of {', '.join(GPUS)} or give --gpu-memory")
    base = GPUS[name or "h100-80gb"]
    if memory_bytes is None:
        return base
    return replace(base, name=f"{base.name if name else 'gpu'}-{memory_bytes / GiB:g}GiB", memory_bytes=memory_bytes)


def pick_links(names: list[str], gpu: GPU) -> tuple[Link, Link]:
    """--interconnect values (repeated or comma-separated): a node link (nvlink, pcie*) sets the
    GPU-to-GPU link inside a node, a network link (ib, roce, tcp) the one between nodes."""
    intra, inter = LINKS[gpu.peer_link], LINKS["ib-ndr"]
    for name in (n.strip() for item in names for n in item.split(",") if n.strip()):
        if name not in LINKS:
            raise ValueError(f"--interconnect {name!r} is not known; choose from {', '.join(LINKS)}")
        if LINKS[name].scope == "node":
            intra = LINKS[name]
        else:
            inter = LINKS[name]
    return intra, inter


def load_profile(path: str) -> dict[str, Any]:
    """Read a `shardserve doctor --json` file; ValueError if it is not one."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--profile {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or "profile" not in data:
        raise ValueError(f"--profile {path} has no 'profile' section: write it with `shardserve doctor --json`")
    return data["profile"]


def apply_profile(profile: dict[str, Any], gpu: GPU, intra: Link, inter: Link) -> tuple[GPU, Link, Link, list[str]]:
    """Measured numbers replace built-in ones; returns what changed, for the report."""
    notes = []
    if profile.get("hbm_bandwidth"):
        gpu = replace(gpu, hbm_bandwidth=float(profile["hbm_bandwidth"]))
        notes.append(f"HBM bandwidth {gpu.hbm_bandwidth / 1e12:.2f} TB/s (measured)")
    for key, scope in (("intra_node", "node"), ("inter_node", "network")):
        link = (profile.get("links") or {}).get(key)
        if not link:
            continue
        measured = Link(f"measured-{key}", float(link["latency_s"]), float(link["bandwidth"]), scope,
                        str(link.get("source", "doctor")))
        notes.append(f"{key.replace('_', '-')} link: {measured.latency_s * 1e6:.0f} us + "
                     f"{measured.bandwidth / 1e9:.1f} GB/s ({measured.source})")
        if scope == "node":
            intra = measured
        else:
            inter = measured
    return gpu, intra, inter, notes
