"""`kog topo --record DIR`: the recording reads back (`--sysfs-root DIR`) as the recorded machine."""
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from topology import TopologyError, plan, probe
from topology.cli import main
from topology.record import record, sysfs_view
from topology.report import to_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "tests", "fixtures", "topology")
ALLOWED = re.compile(r"^(recorded\.json|kog-links\.json|devices/system/cpu/online"
                     r"|devices/system/cpu/cpu\d+/topology/thread_siblings_list"
                     r"|devices/system/node/node\d+/(cpulist|meminfo)"
                     r"|bus/pci/devices/[0-9a-f:.]+(/(vendor|device|class|numa_node|local_cpulist))?"
                     r"|devices/.*/[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]/"
                     r"(vendor|device|class|numa_node|local_cpulist))$")


def fx(name):
    return os.path.join(FIX, name)


def kog_topo(*args):
    return subprocess.run([sys.executable, "-m", "topology.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def tree(root):
    """-> {relative path: link text, or None for a file}: every file and symlink under root."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            path = os.path.join(d, name)
            out[os.path.relpath(path, root)] = os.readlink(path) if os.path.islink(path) else None
    return out


def check_tree(root):
    """Only the files the probe reads; PCI entries are relative links that stay inside the tree."""
    for rel, link in tree(root).items():
        assert ALLOWED.match(rel), rel
        if link is not None:
            assert not os.path.isabs(link) and rel.startswith("bus/pci/devices/"), (rel, link)
            real = os.path.realpath(os.path.join(root, rel))
            assert real.startswith(os.path.realpath(root) + os.sep) and os.path.isdir(real)
    with open(os.path.join(root, "devices/system/node/node0/meminfo")) as f:
        assert all("MemTotal:" in ln for ln in f)


def model(m):
    """The whole `kog topo --json` document, less the sources (they name the tree)."""
    doc = to_json(m, plan(m, None))
    doc["machine"].pop("sources")
    return doc


def test_record_this_machine(tmp_path):
    dest = tmp_path / "this"
    r = record(str(dest))
    live, rec = probe(), probe(sysfs_root=str(dest))
    assert r["differences"] == [] and sysfs_view(live) == sysfs_view(rec)
    assert r["gpus"] == len(live.gpus) and r["pci_devices"] > 0
    check_tree(dest)
    with open(dest / "recorded.json") as f:
        meta = json.load(f)
    u = os.uname()                                         # uname -srvm: no host name
    assert meta["source"] == "/sys"
    assert meta["uname"] == f"{u.sysname} {u.release} {u.version} {u.machine}"
    assert meta["kog_topo_json"]["machine"]["cpus"] == to_json(live, None)["machine"]["cpus"]
    if os.path.isdir("/sys/bus/pci/devices") and any(
            os.path.islink(os.path.join("/sys/bus/pci/devices", n))
            for n in os.listdir("/sys/bus/pci/devices")):
        assert [g.pci_path for g in rec.gpus] == [g.pci_path for g in live.gpus]
        assert any(link for link in tree(dest).values())


@pytest.mark.parametrize("name", ["h200_hgx", "vm_1gpu", "cpu_2core", "mi300x_spx_nps1"])
def test_record_a_recorded_tree(tmp_path, name):
    dest = tmp_path / name
    r = record(str(dest), sysfs_root=fx(name))
    assert r["differences"] == []
    assert model(probe(sysfs_root=str(dest))) == model(probe(sysfs_root=fx(name)))
    check_tree(dest)
    want = {k: v for k, v in tree(fx(name)).items() if k not in ("amd-smi.json", "kog-links.json")}
    got = {k: v for k, v in tree(dest).items() if k not in ("recorded.json", "kog-links.json")}
    assert got == want                          # the same files, the same link texts


def test_record_h200_links_and_pcie_paths(tmp_path):
    dest = tmp_path / "h200"
    r = record(str(dest), sysfs_root=fx("h200_hgx"))
    src, rec = probe(sysfs_root=fx("h200_hgx")), probe(sysfs_root=str(dest))
    assert r["links"] == 28 and r["gpus"] == 8
    assert [g.pci_path for g in rec.gpus] == [g.pci_path for g in src.gpus]
    assert len(rec.gpus[0].pci_path) == 5                 # root, root port, switch up, down, GPU
    assert {ln.label for ln in rec.links.values()} == {"NV18"}
    assert {ln.source for ln in rec.links.values()} == {"kog-links.json"}

    def pairs(root):
        with open(os.path.join(root, "kog-links.json")) as f:
            return {(x["a"], x["b"], x["kind"], x.get("width")) for x in json.load(f)["links"]}
    assert pairs(dest) == pairs(fx("h200_hgx"))


class FakeNvml:
    """pynvml for the 8 GPUs of h200_hgx: NV4 between GPUs 2k and 2k+1, PCIe SYS otherwise."""
    NVML_NVLINK_MAX_LINKS = 18
    BUS = ["0000:18:00.0", "0000:1a:00.0", "0000:38:00.0", "0000:3a:00.0",
           "0000:98:00.0", "0000:9a:00.0", "0000:b8:00.0", "0000:ba:00.0"]

    nvmlInit = nvmlShutdown = staticmethod(lambda: None)
    nvmlSystemGetDriverVersion = staticmethod(lambda: "570.86")
    nvmlDeviceGetMemoryInfo = staticmethod(lambda h: SimpleNamespace(total=143771 << 20))
    nvmlDeviceGetCpuAffinity = staticmethod(lambda h, n: [])
    nvmlDeviceGetCount = staticmethod(lambda: 8)
    nvmlDeviceGetHandleByIndex = staticmethod(lambda i: i)
    nvmlDeviceGetName = staticmethod(lambda h: "NVIDIA H200")
    nvmlDeviceGetNvLinkState = staticmethod(lambda h, link: 1 if link < 4 else 0)
    nvmlDeviceGetNvLinkRemoteDeviceType = staticmethod(lambda h, link: 0)
    nvmlDeviceGetTopologyCommonAncestor = staticmethod(lambda a, b: 50)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=("0000" + self.BUS[h]).encode())

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, h, link):
        return SimpleNamespace(busId=self.BUS[h ^ 1])


def test_record_writes_nvml_links(tmp_path):
    dest = tmp_path / "nvml"
    r = record(str(dest), sysfs_root=fx("h200_hgx"), use_nvml=True, nvml_module=FakeNvml())
    live = probe(sysfs_root=fx("h200_hgx"), use_nvml=True, nvml_module=FakeNvml())
    rec = probe(sysfs_root=str(dest))
    assert r["differences"] == [] and r["links"] == 28 and "nvml (driver 570.86)" in live.sources
    assert live.link(0, 1).label == rec.link(0, 1).label == "NV4"
    assert live.link(0, 2).label == rec.link(0, 2).label == "SYS"
    assert {ln.source for ln in rec.links.values()} == {"kog-links.json"}
    with open(dest / "recorded.json") as f:
        assert json.load(f)["kog_topo_json"]["machine"]["gpus"][0]["sources"] == ["sysfs", "nvml"]


def test_cli_record_round_trip(tmp_path):
    dest = tmp_path / "new" / "h200"                     # parents are made
    r = kog_topo("--record", str(dest), "--sysfs-root", fx("h200_hgx"))
    assert r.returncode == 0 and r.stderr == "" and "8 GPUs, 28 links" in r.stdout, r
    a = json.loads(kog_topo("--sysfs-root", str(dest), "--json").stdout)
    b = json.loads(kog_topo("--sysfs-root", fx("h200_hgx"), "--json").stdout)
    assert a["machine"].pop("sources") != b["machine"].pop("sources") and a == b
    empty = tmp_path / "empty"
    empty.mkdir()
    assert kog_topo("--record", str(empty), "--sysfs-root", fx("cpu_2core")).returncode == 0
    assert os.path.isfile(empty / "devices/system/node/node0/cpulist")
    assert [p for p in os.listdir(tmp_path) if p.startswith(".kog-record")] == []


def one_line_error(capsys, argv, *words):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("kog topo: error: "), err
    for w in words:
        assert w in err, err


def test_record_bad_input(tmp_path, capsys, monkeypatch):
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    one_line_error(capsys, ["--record", str(full)], "not empty")
    one_line_error(capsys, ["--record", str(full / "x")], "not a directory")
    one_line_error(capsys, ["--record", str(full / "x" / "y" / "z")], "cannot create")
    one_line_error(capsys, ["--record", str(tmp_path / "a"), "--json"], "--record takes only")
    one_line_error(capsys, ["--record", str(tmp_path / "b"), "--sysfs-root", str(tmp_path / "no")],
                   "no such directory")
    monkeypatch.setattr(os, "access", lambda *a, **k: False)    # root ignores chmod: pretend
    one_line_error(capsys, ["--record", str(tmp_path / "c")], "not writable")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["full"]       # nothing left behind
    with pytest.raises(TopologyError):
        record(str(full))
