"""Recorded machines (tests/fixtures/topology): the facts the probe reports and the plans it makes."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from topology import PlanError, plan, probe
from topology.model import parse_cpulist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "tests", "fixtures", "topology")


def fx(name):
    return os.path.join(FIX, name)


def machine(name, amd=False):
    return probe(sysfs_root=fx(name), amd_smi_json=os.path.join(fx(name), "amd-smi.json") if amd else None)


def kog_topo(*args):
    return subprocess.run([sys.executable, "-m", "topology.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


# --- H200 HGX: 2 NUMA nodes, 4 GPUs each, NV18 between every pair ---------------------------

@pytest.fixture(scope="module")
def h200():
    return machine("h200_hgx")


def test_h200_facts(h200):
    assert len(h200.cpus) == 192 and len(h200.numa_nodes) == 2
    assert [g.name for g in h200.gpus] == ["NVIDIA H200"] * 8       # no NVSwitch, no BMC VGA
    assert [g.numa for g in h200.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert h200.gpus[0].bus_id == "0000:18:00.0" and h200.gpus[7].bus_id == "0000:ba:00.0"
    node0 = set(parse_cpulist("0-47,96-143"))
    assert set(h200.gpus[0].cpus) == node0
    for a in range(8):
        for b in range(8):
            assert h200.link(a, b).label == ("X" if a == b else "NV18")


def test_h200_plan_8_ranks_by_numa(h200):
    p = plan(h200, 8)
    node = {n.id: set(n.cpus) for n in h200.numa_nodes}
    assert [e.gpu for e in p.entries] == list(range(8))
    for e in p.entries:
        want = 0 if e.rank < 4 else 1
        assert e.numa == want and h200.gpus[e.gpu].numa == want
        assert set(e.cores) <= node[want] and len(e.cores) == 24
        for c in e.cores:                                  # whole cores: SMT siblings together
            assert (c + 96 if c < 96 else c - 96) in e.cores
        assert e.link_next == "NV18"
    for nid in (0, 1):                                     # the node's CPUs, split without overlap
        cores = [c for e in p.entries if e.numa == nid for c in e.cores]
        assert len(cores) == len(set(cores)) and set(cores) == node[nid]


def test_h200_plan_4_ranks_stay_on_numa0(h200):
    p = plan(h200, 4)
    assert [e.gpu for e in p.entries] == [0, 1, 2, 3]
    assert {e.numa for e in p.entries} == {0}
    with pytest.raises(PlanError):
        plan(h200, 9)


def test_h200_without_link_file_infers_nvswitch_then_pcie(tmp_path):
    tree = tmp_path / "h200"
    shutil.copytree(fx("h200_hgx"), tree, symlinks=True)
    os.remove(tree / "kog-links.json")
    m = probe(sysfs_root=str(tree))
    assert m.link(0, 5).label == "NV"                      # NVSwitches present, count unknown
    for i in range(5, 9):
        shutil.rmtree(tree / "bus/pci/devices" / f"0000:0{i}:00.0")
    m = probe(sysfs_root=str(tree))
    assert m.link(0, 1).label == "PIX"                     # same PCIe switch
    assert m.link(0, 2).label == "NODE"                    # other host bridge, same NUMA node
    assert m.link(0, 4).label == "SYS"                     # across sockets
    p = plan(m, 2)
    assert [e.gpu for e in p.entries] == [0, 1] and p.entries[0].link_next == "PIX"


def test_h200_cli_report_and_json():
    r = kog_topo("--sysfs-root", fx("h200_hgx"))
    assert r.returncode == 0, r.stderr
    for word in ("GPU0", "NV18", "Legend:", "CPU Affinity", "NUMA Affinity", "Plan: 8 ranks"):
        assert word in r.stdout
    r = kog_topo("--sysfs-root", fx("h200_hgx"), "--json", "--ranks", "4")
    doc = json.loads(r.stdout)
    assert len(doc["machine"]["gpus"]) == 8 and doc["links"]["matrix"][0][1] == "NV18"
    assert [e["gpu"] for e in doc["plan"]["ranks"]] == [0, 1, 2, 3]
    assert doc["plan"]["ranks"][0]["cores_list"] == "0-11,96-107"
    assert "nvml" not in " ".join(doc["machine"]["sources"])   # --sysfs-root switches NVML off

    # --cpu: the plan of CPU-backend ranks, cores only, as many as asked (16 > the 8 GPUs)
    r = kog_topo("--sysfs-root", fx("h200_hgx"), "--json", "--ranks", "16", "--cpu")
    assert r.returncode == 0, r.stderr
    ranks = json.loads(r.stdout)["plan"]["ranks"]
    assert len(ranks) == 16 and all(e["gpu"] is None for e in ranks)
    assert len({c for e in ranks for c in e["cores"]}) == sum(len(e["cores"]) for e in ranks)   # disjoint
    r = kog_topo("--sysfs-root", fx("h200_hgx"), "--json", "--ranks", "16")
    assert r.returncode == 2 and "16 ranks requested but the machine has 8 GPUs" in r.stderr


# --- MI300X: SPX/NPS1 and CPX/NPS4 ----------------------------------------------------------

def test_mi300x_spx_nps1():
    m = machine("mi300x_spx_nps1", amd=True)
    assert len(m.gpus) == 8 and {g.name for g in m.gpus} == {"AMD Instinct MI300X"}
    assert [g.numa for g in m.gpus] == [0] * 4 + [1] * 4
    assert all(g.partition.compute == "SPX" and g.partition.memory == "NPS1" for g in m.gpus)
    assert m.gpus[0].partition.xcds == list(range(8)) and m.gpus[0].partition.iods == [0, 1, 2, 3]
    assert m.link(0, 7).label == "XGMI" and len({g.package for g in m.gpus}) == 8
    p = plan(m, 8)
    assert [e.numa for e in p.entries] == [0] * 4 + [1] * 4
    assert p.entries[0].cores == list(range(0, 24)) and p.entries[7].cores == list(range(168, 192))


def test_mi300x_sysfs_only():
    m = machine("mi300x_spx_nps1")
    assert len(m.gpus) == 8 and all(g.vendor == "amd" and g.partition is None for g in m.gpus)
    assert m.link(0, 1).label == "NODE" and m.link(0, 4).label == "SYS"


@pytest.fixture(scope="module")
def cpx():
    return machine("mi300x_cpx_nps4", amd=True)


def test_mi300x_cpx_nps4_facts(cpx):
    assert len(cpx.gpus) == 64 and len({g.package for g in cpx.gpus}) == 8
    g9 = cpx.gpus[9]
    assert (g9.package, g9.partition.compute, g9.partition.memory, g9.partition.id) == (1, "CPX", "NPS4", 1)
    assert g9.partition.xcds == [1] and g9.partition.iods == [0] and g9.partition.compute_units == 38
    assert cpx.link(8, 15).label == "PKG" and cpx.link(0, 8).label == "XGMI"
    assert cpx.gpus[40].numa == 1


def test_mi300x_cpx_plans(cpx):
    p8 = plan(cpx, 8)                                      # one XCD on each package
    assert [e.gpu for e in p8.entries] == [0, 8, 16, 24, 32, 40, 48, 56]
    assert [e.numa for e in p8.entries] == [0] * 4 + [1] * 4
    p16 = plan(cpx, 16)                                    # two per package, on different IODs
    assert [e.gpu for e in p16.entries[:4]] == [0, 2, 8, 10]
    assert [e.link_next for e in p16.entries[:3]] == ["PKG", "XGMI", "PKG"]
    assert "IOD0" in p16.entries[0].partition and "IOD1" in p16.entries[1].partition
    p64 = plan(cpx, 64)
    assert sorted(e.gpu for e in p64.entries) == list(range(64))
    assert all(len(e.cores) == 3 for e in p64.entries)
    with pytest.raises(PlanError):
        plan(cpx, 65)


def test_cpx_cli_partitions_table():
    r = kog_topo("--sysfs-root", fx("mi300x_cpx_nps4"), "--amd-smi-json",
                 os.path.join(fx("mi300x_cpx_nps4"), "amd-smi.json"), "--json", "--ranks", "8")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["partitions"]) == 64 and doc["partitions"][3]["iods"] == [1]
    assert doc["plan"]["nranks"] == 8


# --- the lent one-GPU VM (numa_node -1) and a CPU-only machine ------------------------------

def test_vm_numa_unknown():
    m = machine("vm_1gpu")
    assert len(m.gpus) == 1 and m.gpus[0].numa is None and m.gpus[0].cpus == list(range(16))
    p = plan(m)
    e = p.entries[0]
    assert (e.gpu, e.cores, e.numa) == (0, list(range(16)), 0)     # the only node there is
    doc = json.loads(kog_topo("--sysfs-root", fx("vm_1gpu"), "--json").stdout)
    assert doc["machine"]["gpus"][0]["numa"] is None
    assert kog_topo("--sysfs-root", fx("vm_1gpu")).stdout.count("N/A") >= 2


def test_h200_x2_recorded():
    """Recorded with `kog topo --record` on the lent 2 x H200 machine (2026-11-29): one NUMA node whose
    GPUs read numa_node -1, 32 CPUs, NV18 between the two GPUs (NVML's view, kept in kog-links.json)."""
    m = machine("h200_x2_lent")
    assert [g.bus_id for g in m.gpus] == ["0000:00:06.0", "0000:00:07.0"] and len(m.cpus) == 32
    assert all(g.numa is None for g in m.gpus)
    link = m.links[(0, 1)]
    assert (link.kind, link.width) == ("NV", 18)
    p = plan(m, 2)
    assert [(e.gpu, e.cores) for e in p.entries] == [(0, list(range(16))), (1, list(range(16, 32)))]
    out = kog_topo("--sysfs-root", fx("h200_x2_lent")).stdout
    assert "NV18" in out and "2 GPUs" in out


def test_cpu_only_two_cores():
    m = machine("cpu_2core")
    assert m.gpus == [] and m.cpus == [0, 1] and [n.id for n in m.numa_nodes] == [0]
    assert [e.cores for e in plan(m, 2).entries] == [[0], [1]]
    assert plan(m).nranks == 1 and plan(m).entries[0].gpu is None
    r = kog_topo("--sysfs-root", fx("cpu_2core"))
    assert r.returncode == 0 and "No GPU found." in r.stdout
