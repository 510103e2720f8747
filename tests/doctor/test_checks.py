"""The doctor's checks against fake /sys, /dev, /proc trees and environments."""
from __future__ import annotations

import os

from shardserve.doctor.checks import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    System,
    check_gpus,
    check_mtu,
    check_nccl_env,
    check_rdma,
    check_topology,
    check_versions,
    nccl_list_matches,
    parse_ibv_devinfo,
    rdma_devices,
)
from shardserve.doctor.run import check_transport, find_node_rank, parse_peers
from shardserve.doctor.topology import parse_nccl_log

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def fake_system(tmp_path, env=None, ifaces=None, ib=None, dev_ib=()) -> System:
    """ifaces: name -> MTU; ib: device -> (link_layer, state, netdevs, {gid index: type})."""
    sysfs, dev, proc = tmp_path / "sys", tmp_path / "dev", tmp_path / "proc"
    for name, mtu in (ifaces or {"eth0": 1500, "lo": 65536}).items():
        _write(sysfs / "class" / "net" / name / "mtu", str(mtu))
    _write(proc / "net" / "route", "Iface\tDestination\tGateway\nlo\t0000007F\t00000000\n"
           + f"{next(iter(ifaces or {'eth0': 0}))}\t00000000\t0101A8C0")
    for name, (layer, state, netdevs, gids) in (ib or {}).items():
        port = sysfs / "class" / "infiniband" / name / "ports" / "1"
        _write(port / "state", state)
        _write(port / "link_layer", layer)
        _write(port / "rate", "400 Gb/sec (4X NDR)")
        for idx, kind in gids.items():
            _write(port / "gid_attrs" / "types" / idx, kind)
        for nd in netdevs:
            os.makedirs(sysfs / "class" / "infiniband" / name / "device" / "net" / nd, exist_ok=True)
    for entry in dev_ib:
        _write(dev / "infiniband" / entry, "")
    return System(str(sysfs), str(dev), str(proc), dict(env or {}), which=lambda name: None)


def test_cpu_machine_says_so():
    info = {"torch": "2.13.0+cpu", "cuda": None, "gpus": [], "nccl": None, "driver": None}
    gpus = check_gpus(info)
    assert gpus.status == WARN and "no CUDA GPU visible" in gpus.detail and gpus.fix
    assert check_versions(info).status == PASS


def test_gpu_machine_reports_versions():
    info = {"torch": "2.11.0", "cuda": "13.0", "driver": "580.65", "nccl": "2.27.3",
            "gpus": [{"index": i, "name": "NVIDIA H200", "memory_bytes": 150 * 2**30, "capability": "9.0"}
                     for i in range(2)]}
    assert check_gpus(info).detail == "2 x NVIDIA H200, 150.0 GiB each"
    assert check_versions(info).detail == "torch 2.11.0, CUDA 13.0, driver 580.65, NCCL 2.27.3"
    assert check_versions(dict(info, nccl=None)).status == FAIL


def test_topology_check_reads_nvidia_smi(tmp_path):
    s = fake_system(tmp_path)
    assert check_topology(s).status == SKIP
    s.which = lambda name: "/usr/bin/" + name
    pcie = open(os.path.join(FIXTURES, "topo", "l40sx4_pcie.reconstructed.txt")).read()
    warn = check_topology(s, run=lambda cmd: pcie)
    assert warn.status == WARN and "TP=2 on GPU0-GPU1 crosses PIX" in warn.detail and warn.fix
    nv = open(os.path.join(FIXTURES, "topo", "h200x2_nv18.real.txt")).read()
    ok = check_topology(s, run=lambda cmd: nv)
    assert ok.status == PASS and "every pair NVLink (1 x NV18)" in ok.detail


def test_no_rdma_is_skipped_on_one_node_and_a_warning_across_nodes(tmp_path):
    s = fake_system(tmp_path, dev_ib=["rdma_cm"])          # the 2x H200 machine: /dev/infiniband has only rdma_cm
    assert rdma_devices(s) == []
    one = check_rdma(s, [], multi_node=False)
    assert one.status == SKIP and "only rdma_cm" in one.detail
    assert check_rdma(s, [], multi_node=True).status == WARN


def test_infiniband_port_states_and_uverbs(tmp_path):
    ib = {"mlx5_0": ("InfiniBand", "4: ACTIVE", [], {}), "mlx5_1": ("InfiniBand", "1: DOWN", [], {})}
    s = fake_system(tmp_path, ib=ib, dev_ib=["rdma_cm", "uverbs0", "uverbs1"])
    devices = rdma_devices(s)
    assert [(d["name"], d["ports"][0]["state"], d["ports"][0]["link_layer"]) for d in devices] == \
        [("mlx5_0", "ACTIVE", "InfiniBand"), ("mlx5_1", "DOWN", "InfiniBand")]
    down = check_rdma(s, devices, multi_node=True)
    assert down.status == WARN and "mlx5_1:1 DOWN" in down.fix
    no_verbs = fake_system(tmp_path / "c", ib={"mlx5_0": ("InfiniBand", "4: ACTIVE", [], {})}, dev_ib=["rdma_cm"])
    assert "uverbs" in check_rdma(no_verbs, rdma_devices(no_verbs), True).detail


def test_roce_needs_jumbo_frames_and_a_v2_gid(tmp_path):
    ib = {"mlx5_0": ("Ethernet", "4: ACTIVE", ["ens1f0"], {"0": "IB/RoCE v1", "3": "RoCE v2"})}
    ifaces = {"ens1f0": 1500, "eth0": 1500, "lo": 65536}
    s = fake_system(tmp_path, ib=ib, ifaces=ifaces, dev_ib=["uverbs0"])
    devices = rdma_devices(s)
    assert check_rdma(s, devices, True).status == PASS
    mtu = check_mtu(s, devices)
    assert mtu.status == WARN and "ens1f0 MTU 1500 (RoCE)" in mtu.detail and "mtu 9000" in mtu.fix
    env = check_nccl_env(s, devices)
    assert env.status == WARN and "NCCL_IB_GID_INDEX is not set" in env.detail
    s.environ = {"NCCL_IB_GID_INDEX": "0"}
    assert "not RoCE v2" in check_nccl_env(s, devices).detail
    s.environ = {"NCCL_IB_GID_INDEX": "3", "NCCL_SOCKET_IFNAME": "ens1f0", "NCCL_IB_HCA": "mlx5_0:1"}
    assert check_nccl_env(s, devices).status == PASS
    jumbo = fake_system(tmp_path / "j", ib=ib, ifaces={"ens1f0": 9000}, dev_ib=["uverbs0"])
    assert check_mtu(jumbo, rdma_devices(jumbo)).status == PASS


def test_nccl_env_names_that_match_nothing_fail(tmp_path):
    s = fake_system(tmp_path, env={"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_9"})
    bad = check_nccl_env(s, [])
    assert bad.status == FAIL and "NCCL_SOCKET_IFNAME=ib0 matches no interface (have eth0, lo)" in bad.detail
    assert "NCCL_IB_HCA=mlx5_9 matches no RDMA device" in bad.detail
    assert check_nccl_env(fake_system(tmp_path / "b"), []).detail.startswith("no NCCL_* variables")
    assert check_mtu(fake_system(tmp_path / "m", env={"NCCL_SOCKET_IFNAME": "=lo"}), []).detail == \
        "lo MTU 65536 (NCCL socket interface)"


def test_nccl_list_syntax():
    names = ["eth0", "eth1", "ens1f0", "lo"]
    assert nccl_list_matches("eth", names) == ["eth0", "eth1"]
    assert nccl_list_matches("=eth", names) == []
    assert nccl_list_matches("^lo,docker", names) == ["eth0", "eth1", "ens1f0"]
    assert nccl_list_matches("mlx5_0:1,mlx5_1:1", ["mlx5_0", "mlx5_1", "mlx5_2"]) == ["mlx5_0", "mlx5_1"]


def test_transport_verdicts_from_nccl_logs():
    def verdict(name, nvlink=None):
        with open(os.path.join(FIXTURES, "nccl", name)) as f:
            return check_transport(parse_nccl_log(f.read()), nvlink)
    p2p = verdict("h200x2_p2p.real.log", nvlink=True)
    assert p2p.status == PASS and p2p.detail == "NCCL 2.28.9: P2P over NVLink"
    ib = verdict("2node_ib_gdrdma.reconstructed.log")
    assert ib.status == PASS and "NET, P2P (IB), GPUDirect RDMA" in ib.detail
    assert verdict("2node_roce_nogdr.reconstructed.log").status == WARN
    assert verdict("h200x2_shm.real.log").status == WARN   # NCCL_P2P_DISABLE=1
    assert verdict("h200x2_socket.real.log").status == FAIL   # and NCCL_SHM_DISABLE=1
    sock = verdict("2node_socket_fallback.reconstructed.log")
    assert sock.status == FAIL and "fell back to NET/Socket" in sock.detail


def test_peers_parsing_and_which_one_is_this_node():
    assert parse_peers("10.0.0.1:29500, node-b:29500") == [("10.0.0.1", 29500), ("node-b", 29500)]
    for bad in ("10.0.0.1", "10.0.0.1:x,10.0.0.2:1", "10.0.0.1:1"):
        try:
            parse_peers(bad)
        except ValueError:
            continue
        raise AssertionError(bad)
    assert find_node_rank([("192.0.2.77", 1), ("127.0.0.1", 1)]) == 1   # TEST-NET-1 is nobody's address
    try:
        find_node_rank([("127.0.0.1", 1), ("127.0.0.1", 2)])
    except ValueError as e:
        assert "--node-rank" in str(e)
    else:
        raise AssertionError("two local entries must ask for --node-rank")


def test_ibv_devinfo_when_sysfs_shows_no_devices():
    # Reconstructed in ibv_devinfo's format (rdma-core 50): one IB port up, one RoCE port down.
    text = """hca_id:\tmlx5_0
\ttransport:\t\t\tInfiniBand (0)
\tfw_ver:\t\t\t\t28.39.1002
\tphys_port_cnt:\t\t\t1
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
\t\t\tmax_mtu:\t\t4096 (5)
\t\t\tactive_mtu:\t\t4096 (5)
\t\t\tlink_layer:\t\tInfiniBand

hca_id:\tmlx5_1
\ttransport:\t\t\tInfiniBand (0)
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_DOWN (1)
\t\t\tactive_mtu:\t\t1024 (3)
\t\t\tlink_layer:\t\tEthernet
"""
    devices = parse_ibv_devinfo(text)
    assert [(d["name"], p["state"], p["link_layer"], p["active_mtu"]) for d in devices for p in d["ports"]] == \
        [("mlx5_0", "ACTIVE", "InfiniBand", "4096"), ("mlx5_1", "DOWN", "Ethernet", "1024")]
