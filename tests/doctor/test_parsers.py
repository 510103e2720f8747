"""`nvidia-smi topo -m` and NCCL_DEBUG=INFO parsers against stored outputs.

Every `fixtures/topo/*.txt` and `fixtures/nccl/*.log` is checked against the JSON of the same name
beside it (only the keys the JSON lists; dict values only for the sub-keys listed). Names say what
a file is: `*.real.*` for captures from real machines, `*.reconstructed.*` for files written in the
tool's format by hand. To add a capture, drop `NAME.real.txt` (or `.log`) and `NAME.real.json` in
the folder; nothing else to change."""
from __future__ import annotations

import glob
import json
import os

import pytest

from shardserve.doctor.topology import parse_nccl_log, parse_topo, topology_warnings

HERE = os.path.join(os.path.dirname(__file__), "fixtures")
TOPO = sorted(glob.glob(os.path.join(HERE, "topo", "*.txt")))
NCCL = sorted(glob.glob(os.path.join(HERE, "nccl", "*.log")))


def _expected(path: str) -> dict:
    expected = os.path.splitext(path)[0] + ".json"
    assert os.path.isfile(expected), f"{os.path.basename(path)} needs {os.path.basename(expected)} beside it"
    with open(expected) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def _compare(got: dict, expected: dict) -> None:
    for key, want in expected.items():
        value = got[key]
        if isinstance(want, dict):
            value = {k: value.get(k) for k in want}
        assert value == want, key


def test_fixture_names_say_real_or_reconstructed():
    assert TOPO and NCCL
    for path in TOPO + NCCL:
        assert ".real." in path or ".reconstructed." in path, path
    assert any(".real." in p for p in TOPO)


@pytest.mark.parametrize("path", TOPO, ids=os.path.basename)
def test_topo(path):
    with open(path, encoding="utf-8") as f:
        topo = parse_topo(f.read())
    got = dict(topo.to_dict(), warnings=topology_warnings(topo))
    _compare(got, _expected(path))


@pytest.mark.parametrize("path", NCCL, ids=os.path.basename)
def test_nccl_log(path):
    with open(path, encoding="utf-8") as f:
        _compare(parse_nccl_log(f.read()), _expected(path))


def test_topo_tolerates_spaces_instead_of_tabs_and_rejects_non_matrices():
    text = open(os.path.join(HERE, "topo", "h200x2_nv18.real.txt"), encoding="utf-8").read()
    spaced = text.replace("\t", "    ")                      # as pasted from a terminal
    topo = parse_topo(spaced)
    assert topo.gpus == ["GPU0", "GPU1"] and topo.link("GPU1", "GPU0") == "NV18"
    with pytest.raises(ValueError, match="no `nvidia-smi topo -m` matrix"):
        parse_topo("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_nccl_log_without_channel_lines():
    got = parse_nccl_log("host:1:1 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>\n")
    assert got["channels"] == 0 and got["transports"] == [] and got["version"] is None
