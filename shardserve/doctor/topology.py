"""Parsers for what GPUs and NCCL say about their links: `nvidia-smi topo -m` and NCCL_DEBUG=INFO logs.

Both are tolerant: nvidia-smi's matrix changed over driver releases (NIC columns named `mlx5_0`
directly or `NIC0` with a legend, a `GPU NUMA ID` column or not, ANSI underline in the header,
tabs with empty cells) and NCCL's INFO lines too (bus ids or device numbers in `0[0]`, `/0` after
the channel or not, `[send]`/`[receive]` on network channels). Unknown lines are ignored."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NV = re.compile(r"^NV(\d+)$")
# Slowest last: how far apart two devices are, as nvidia-smi's legend orders them.
PCIE_ORDER = ["PIX", "PXB", "PHB", "NODE", "SYS"]


@dataclass
class Topology:
    gpus: list[str] = field(default_factory=list)
    nics: list[str] = field(default_factory=list)          # RDMA NIC names (mlx5_0), legend resolved
    matrix: dict[tuple[str, str], str] = field(default_factory=dict)
    cpu_affinity: dict[str, str] = field(default_factory=dict)
    numa_affinity: dict[str, str] = field(default_factory=dict)

    def link(self, a: str, b: str) -> str:
        return self.matrix.get((a, b)) or self.matrix.get((b, a)) or "?"

    def gpu_pairs(self) -> list[tuple[str, str, str]]:
        return [(a, b, self.link(a, b)) for i, a in enumerate(self.gpus) for b in self.gpus[i + 1:]]

    @property
    def all_nvlink(self) -> bool:
        return bool(self.gpus) and all(is_nvlink(code) for _, _, code in self.gpu_pairs())

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for _, _, code in self.gpu_pairs():
            counts[code] = counts.get(code, 0) + 1
        return {"gpus": self.gpus, "nics": self.nics, "links": {f"{a}-{b}": c for a, b, c in self.gpu_pairs()},
                "nic_links": {f"{g}-{n}": self.link(g, n) for g in self.gpus for n in self.nics},
                "link_counts": counts, "cpu_affinity": self.cpu_affinity, "numa_affinity": self.numa_affinity,
                "all_nvlink": self.all_nvlink}


def is_nvlink(code: str) -> bool:
    return bool(_NV.match(code))


def _cells(line: str) -> list[str]:
    # nvidia-smi separates cells with tabs (some cells empty); copies pasted from terminals have spaces.
    return line.split("\t") if "\t" in line else re.split(r"\s{2,}", line)


def parse_topo(text: str) -> Topology:
    """`nvidia-smi topo -m` output -> Topology. ValueError if there is no matrix in it."""
    lines = [_ANSI.sub("", l).rstrip("\n") for l in text.splitlines()]
    head = next((i for i, l in enumerate(lines) if re.search(r"\bGPU0\b", l) and _cells(l)[0].strip() == ""), None)
    if head is None:
        raise ValueError("no `nvidia-smi topo -m` matrix found (no header row starting with GPU0)")
    columns = [c.strip() for c in _cells(lines[head])[1:]]
    columns = [c for c in columns if c]
    # Device columns (GPU0, NIC0 or mlx5_0, bnxt_re0...) come first; the rest have spaces in their names.
    devices = columns[:next((i for i, c in enumerate(columns) if " " in c), len(columns))]
    extra = columns[len(devices):]                     # CPU Affinity, NUMA Affinity, GPU NUMA ID
    topo = Topology()
    for line in lines[head + 1:]:
        cells = _cells(line)
        name = cells[0].strip() if cells else ""
        if not name or name.startswith("Legend") or name not in devices:
            if name.startswith("Legend") or (topo.matrix and not name):
                break
            continue
        values = [c.strip() for c in cells[1:]]
        links, rest = values[:len(devices)], [v for v in values[len(devices):] if v]
        for other, code in zip(devices, links):
            topo.matrix[(name, other)] = code
        info = dict(zip(extra, rest))
        if name.startswith("GPU"):
            topo.gpus.append(name)
            if "CPU Affinity" in info:
                topo.cpu_affinity[name] = info["CPU Affinity"]
            if "NUMA Affinity" in info:
                topo.numa_affinity[name] = info["NUMA Affinity"]
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", "\n".join(lines), re.MULTILINE))
    nics = [d for d in devices if not d.startswith("GPU")]
    if legend:   # NIC0 -> mlx5_0 everywhere
        topo.matrix = {(legend.get(a, a), legend.get(b, b)): c for (a, b), c in topo.matrix.items()}
    topo.nics = [legend.get(n, n) for n in nics]
    return topo


def topology_warnings(topo: Topology) -> list[str]:
    """TP groups are consecutive ranks: say which group sizes would put an all-reduce on a slow link."""
    out = []
    size = 2
    while size <= len(topo.gpus):
        for start in range(0, len(topo.gpus) - size + 1, size):
            group = topo.gpus[start:start + size]
            pairs = [(a, b, topo.link(a, b)) for i, a in enumerate(group) for b in group[i + 1:]]
            slow = [p for p in pairs if not is_nvlink(p[2])]
            if slow:
                worst = max(slow, key=lambda s: PCIE_ORDER.index(s[2]) if s[2] in PCIE_ORDER else -1)
                out.append(f"TP={size} on {group[0]}-{group[-1]} crosses {worst[2]} ({worst[0]}-{worst[1]}), "
                           "not NVLink")
                break
        size *= 2
    return out


# ---- NCCL_DEBUG=INFO --------------------------------------------------------------------------
_CHANNEL = re.compile(r"Channel (\d+)(?:/\d+)?\s*:\s*(\d+)\[([0-9a-fA-Fx]+)\]\s*->\s*(\d+)\[([0-9a-fA-Fx]+)\]"
                      r"\s*(?:\[(send|receive)\]\s*)?via\s+(.+?)\s*$")
_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)(?:\+cuda(\d+\.\d+))?")


def _transport(detail: str) -> tuple[str, str | None]:
    """'P2P/CUMEM/read' -> ('P2P', None); 'NET/IB/0/GDRDMA' -> ('NET', 'IB'); 'NET/Socket/1' -> ('NET', 'Socket')."""
    parts = detail.split("/")
    kind = parts[0].strip()
    if kind == "NET" and len(parts) > 1:
        net = parts[1].strip()
        return "NET", "IB" if net.lower().startswith("ib") else net
    return kind, None


def parse_nccl_log(text: str) -> dict[str, Any]:
    """What an NCCL_DEBUG=INFO log says about the transports NCCL chose."""
    channels, transports, nets = [], set(), set()
    gdr = False
    for line in text.splitlines():
        m = _CHANNEL.search(line)
        if not m:
            continue
        detail = m.group(7)
        kind, net = _transport(detail)
        transports.add(kind)
        if net:
            nets.add(net)
        gdr |= "GDRDMA" in detail
        channels.append({"channel": int(m.group(1)), "src": int(m.group(2)), "dst": int(m.group(4)),
                         "direction": m.group(6), "via": detail})
    version = _VERSION.search(text)
    ib_line = re.search(r"NET/IB\w* : Using (.+?)(?:;|$)", text, re.MULTILINE)
    sock_line = re.search(r"NET/Socket : Using (.+)$", text, re.MULTILINE)
    network = re.findall(r"Using network (\S+)", text)
    nnodes = [int(n) for n in re.findall(r"nNodes (\d+)", text)]
    nvls = [int(n) for n in re.findall(r"(\d+) nvls channels", text)]
    ib_devices = re.findall(r"\[\d+\]([\w.-]+:\d+/\w+)", ib_line.group(1)) if ib_line else []
    return {
        "version": version.group(1) if version else None,
        "cuda": version.group(2) if version else None,
        "transports": sorted(transports),
        "net": sorted(nets)[0] if len(nets) == 1 else (sorted(nets) or None),
        "network_plugin": network[-1] if network else None,
        "gdrdma": gdr,
        "ib_devices": ib_devices,
        "ib_found": bool(ib_devices) and "No device found" not in text,
        "socket_interfaces": re.findall(r"\[\d+\]([\w.-]+):", sock_line.group(1)) if sock_line else [],
        "gdr_disabled": bool(re.search(r"GPU Direct RDMA Disabled", text)),
        "nnodes": max(nnodes) if nnodes else None,
        "nvls": bool(nvls and max(nvls) > 0),
        "path_types": sorted(set(re.findall(r"type (\w+)/\w+, sameChannels", text))),
        "channels": len(channels),
        "socket_fallback": "Socket" in nets,
    }
