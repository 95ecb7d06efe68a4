"""Pieces of topology/: cpulists, PCIe classification, NVML through a fake module, amd-smi forms."""
import json
import os
from types import SimpleNamespace

import pytest

from topology import TopologyError, plan, probe
from topology.bind import cuda_ordinal
from topology.model import format_cpulist, normalize_bus_id, parse_cpulist
from topology.probe import pcie_link
from topology.probe_amd import parse_amd_smi
from topology.probe_nvml import probe_nvml

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "topology")


def test_cpulists():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []
    assert format_cpulist([11, 10, 0, 1, 2, 3, 8]) == "0-3,8,10-11"
    for bad in ("a", "3-1", "1,,2", "-1"):
        with pytest.raises(TopologyError):
            parse_cpulist(bad)
    assert normalize_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert normalize_bus_id("0000:0C:00.3") == "0000:0c:00.3"


def test_pcie_classification():
    root = ["pci0000:15", "0000:15:01.0", "0000:16:00.0"]
    a = root + ["0000:17:00.0", "0000:18:00.0"]
    b = root + ["0000:17:01.0", "0000:1a:00.0"]
    deep = root + ["0000:17:02.0", "0000:1b:00.0", "0000:1c:00.0", "0000:1d:00.0"]
    assert pcie_link(a, b, 0, 0, False).kind == "PIX"
    assert pcie_link(a, deep, 0, 0, False).kind == "PXB"
    assert pcie_link(a, ["pci0000:15", "0000:15:02.0", "0000:30:00.0"], 0, 0, False).kind == "PHB"
    other = ["pci0000:95", "0000:95:01.0", "0000:96:00.0"]
    assert pcie_link(a, other, 0, 0, False).kind == "NODE"
    assert pcie_link(a, other, 0, 1, False).kind == "SYS"
    assert pcie_link([], [], None, None, False).kind == "?"
    assert pcie_link([], [], None, None, True).kind == "NODE"


class FakeNvml:
    """Enough of pynvml for probe_nvml: `remote[i]` lists GPU i's active links ('switch' or a bus)."""
    NVML_NVLINK_MAX_LINKS = 18
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2

    def __init__(self, buses, remote, numa, level=40, fail_init=False):
        self.buses, self.remote, self.numa, self.level, self.fail = buses, remote, numa, level, fail_init
        self.shutdown = False

    def nvmlInit(self):
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetCount(self):
        return len(self.buses)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=("0000" + self.buses[h]).encode())

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=143771 << 20)

    def nvmlDeviceGetNumaNodeId(self, h):
        return self.numa[h]

    def nvmlDeviceGetCpuAffinity(self, h, n):
        return [0b1111 << (4 * h)]

    def nvmlDeviceGetNvLinkState(self, h, link):
        return 1 if link < len(self.remote[h]) else 0

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return 2 if self.remote[h][link] == "switch" else 0

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, h, link):
        return SimpleNamespace(busId=self.remote[h][link])

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.level

    def nvmlSystemGetDriverVersion(self):
        return "570.86"


def test_nvml_switch_and_direct_links():
    buses = ["0000:18:00.0", "0000:1a:00.0", "0000:98:00.0"]
    sw = FakeNvml(buses, [["switch"] * 18] * 3, [0, 0, 1])
    info = probe_nvml(sw)
    assert sw.shutdown and info.driver == "570.86"
    assert [g.numa for g in info.gpus] == [0, 0, 1] and info.gpus[1].cpus == [4, 5, 6, 7]
    assert info.gpus[0].memory_mb == 143771
    assert {ln.label for ln in info.links.values()} == {"NV18"}
    direct = FakeNvml(buses, [["0000:1a:00.0"] * 4, ["0000:18:00.0"] * 4, []], [0, 0, -1], level=50)
    info = probe_nvml(direct)
    assert info.links[("0000:18:00.0", "0000:1a:00.0")].label == "NV4"
    assert info.links[("0000:18:00.0", "0000:98:00.0")].label == "SYS"
    assert info.gpus[2].numa is None
    assert probe_nvml(FakeNvml(buses, [[]] * 3, [0] * 3, fail_init=True)) is None


def test_nvml_merges_with_sysfs_and_keeps_unknown_numa():
    fake = FakeNvml(["0000:00:05.0"], [[]], [-1])
    m = probe(sysfs_root=os.path.join(FIX, "vm_1gpu"), use_nvml=True, nvml_module=fake)
    assert len(m.gpus) == 1 and m.gpus[0].sources == ["sysfs", "nvml"]
    assert m.gpus[0].memory_mb == 143771 and m.gpus[0].numa is None
    assert any(s.startswith("nvml") for s in m.sources)


def test_nvml_only_gpus_are_planned():
    fake = FakeNvml(["0000:18:00.0", "0000:1a:00.0"], [["switch"] * 18] * 2, [0, 0])
    m = probe(sysfs_root=os.path.join(FIX, "cpu_2core"), use_nvml=True, nvml_module=fake)
    assert [g.bus_id for g in m.gpus] == ["0000:18:00.0", "0000:1a:00.0"]
    p = plan(m, 2)
    assert [e.gpu for e in p.entries] == [0, 1] and p.entries[0].link_next == "NV18"
    assert cuda_ordinal(m, 1) == 1


def test_cuda_ordinal_respects_visible_devices(monkeypatch):
    m = probe(sysfs_root=os.path.join(FIX, "h200_hgx"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert cuda_ordinal(m, 5) == 1 and cuda_ordinal(m, 0) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda_ordinal(m, 5) == 5


def amd_doc(name):
    with open(os.path.join(FIX, name, "amd-smi.json")) as f:
        return json.load(f)


def test_amd_smi_forms():
    doc = amd_doc("mi300x_spx_nps1")
    bundle = parse_amd_smi(doc)
    assert len(bundle.gpus) == 8 and len(bundle.links) == 28
    topo_only = parse_amd_smi(doc["topology"])
    assert [g.bus_id for g in topo_only.gpus] == [g.bus_id for g in bundle.gpus]
    assert len(topo_only.links) == 28 and topo_only.gpus[0].partition is None
    newer = [dict(e) for e in doc["static"]]
    for e in newer:   # later releases name the compute partition "accelerator_partition"
        e["partition"] = {"accelerator_partition": "CPX", "memory_partition": "NPS4",
                          "partition_id": 0}
    env = parse_amd_smi({"gpu_data": newer})
    assert env.gpus[0].partition.compute == "CPX" and env.links == {}


def test_amd_smi_numa_used_when_sysfs_has_no_gpu():
    m = probe(sysfs_root=os.path.join(FIX, "cpu_2core"),
              amd_smi_json=os.path.join(FIX, "mi300x_spx_nps1", "amd-smi.json"))
    assert len(m.gpus) == 8 and [g.numa for g in m.gpus] == [0] * 4 + [1] * 4
    assert m.link(0, 1).label == "XGMI"


def test_cpu_plan_on_a_gpu_machine():
    m = probe(sysfs_root=os.path.join(FIX, "vm_1gpu"))
    p = plan(m, 4, use_gpus=False)
    assert [e.gpu for e in p.entries] == [None] * 4
    assert [e.cores for e in p.entries] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_tree_with_pci_devices_only(tmp_path):
    """No node or CPU files: the CPUs come from the devices' local_cpulist, one node assumed."""
    for i in (1, 2):
        d = tmp_path / "bus/pci/devices" / f"0000:0{i}:00.0"
        d.mkdir(parents=True)
        for name, text in (("vendor", "0x10de"), ("class", "0x030200"), ("numa_node", "-1"),
                           ("local_cpulist", "0-7")):
            (d / name).write_text(text + "\n")
    m = probe(sysfs_root=str(tmp_path))
    assert m.cpus == list(range(8)) and [g.numa for g in m.gpus] == [None, None]
    assert [e.cores for e in plan(m).entries] == [[0, 1, 2, 3], [4, 5, 6, 7]]
