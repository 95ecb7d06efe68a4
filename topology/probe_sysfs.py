"""Read CPUs, NUMA nodes and PCI GPUs from sysfs: the live /sys or a recorded tree with the same layout.

Layout read (everything under ROOT; only the first two are needed):
  ROOT/devices/system/node/node*/cpulist                          NUMA nodes and their CPUs
  ROOT/bus/pci/devices/*/{vendor,device,class,numa_node,local_cpulist}
  ROOT/devices/system/node/node*/meminfo                          optional, node memory
  ROOT/devices/system/cpu/online                                  optional, online CPUs
  ROOT/devices/system/cpu/cpu*/topology/thread_siblings_list      optional, SMT siblings
  ROOT/bus/pci/devices/* as symlinks into ROOT/devices/pci*/...    optional, the PCIe path of a
                                                                  device (PIX/PXB/PHB/NODE/SYS)
  ROOT/kog-links.json                                             optional recording aid (below)
`kog-links.json` records what sysfs cannot show (NVLink): {"links": [{"a": BUS_ID, "b": BUS_ID,
"kind": "NV", "width": 18}, ...]}. Without it NVLink is inferred only when NVSwitches are present.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from .model import Link, NumaNode, TopologyError, normalize_bus_id, parse_cpulist

BDF_RE = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
ROOT_RE = re.compile(r"^pci[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}$")
VENDORS = {0x10DE: "nvidia", 0x1002: "amd"}


@dataclass
class PciDevice:
    bus_id: str
    vendor_id: int
    device_id: int
    class_id: int
    numa: int | None
    local_cpus: list[int]
    path: list[str] = field(default_factory=list)   # host bridge, bridges..., the device

    @property
    def vendor(self) -> str:
        return VENDORS.get(self.vendor_id, "other")

    @property
    def is_gpu(self) -> bool:
        base, sub = self.class_id >> 16, (self.class_id >> 8) & 0xFF
        gpu_class = base == 0x03 or (base == 0x12 and sub == 0x00)
        return self.vendor_id in VENDORS and gpu_class

    @property
    def is_nvswitch(self) -> bool:
        return self.vendor_id == 0x10DE and (self.class_id >> 8) == 0x0680


@dataclass
class SysfsInfo:
    root: str
    cpus: list[int]
    numa_nodes: list[NumaNode]
    devices: list[PciDevice]
    cpu_siblings: dict[int, tuple[int, ...]]
    extra_links: dict[tuple[str, str], Link]
    notes: list[str]

    @property
    def gpus(self) -> list[PciDevice]:
        return sorted((d for d in self.devices if d.is_gpu), key=lambda d: d.bus_id)

    @property
    def nvswitches(self) -> list[PciDevice]:
        return [d for d in self.devices if d.is_nvswitch]


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as e:
        raise TopologyError(f"cannot read {path}: {e.strerror}") from None


def _hex(path: str, strict: bool) -> int | None:
    text = _read(path)
    if text is None:
        if strict:
            raise TopologyError(f"{path}: missing")
        return None
    try:
        return int(text, 16)
    except ValueError:
        raise TopologyError(f"{path}: not a hex number: {text[:40]!r}") from None


def _numa_of(path: str) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        v = int(text)
    except ValueError:
        raise TopologyError(f"{path}: not an integer: {text[:40]!r}") from None
    return v if v >= 0 else None


def _cpulist(path: str) -> list[int] | None:
    text = _read(path)
    return None if text is None else parse_cpulist(text, path)


def _numa_nodes(root: str) -> list[NumaNode]:
    base = os.path.join(root, "devices/system/node")
    nodes = []
    names = os.listdir(base) if os.path.isdir(base) else []
    for name in names:
        m = re.fullmatch(r"node(\d+)", name)
        if not m:
            continue
        cpus = _cpulist(os.path.join(base, name, "cpulist"))
        if cpus is None:
            raise TopologyError(f"{os.path.join(base, name, 'cpulist')}: missing")
        mem = None
        meminfo = _read(os.path.join(base, name, "meminfo"))
        if meminfo:
            mm = re.search(r"MemTotal:\s+(\d+)\s*kB", meminfo)
            mem = int(mm.group(1)) // 1024 if mm else None
        nodes.append(NumaNode(int(m.group(1)), cpus, mem))
    return sorted(nodes, key=lambda n: n.id)


def _pci_path(devdir: str, entry: str, bus_id: str) -> list[str]:
    if not os.path.islink(entry):
        return []
    parts = os.readlink(entry).split("/")
    chain = [p for p in parts if ROOT_RE.match(p) or BDF_RE.match(p)]
    chain = [p if ROOT_RE.match(p) else normalize_bus_id(p) for p in chain]
    return chain if chain and chain[-1] == bus_id and ROOT_RE.match(chain[0]) else []


def _devices(root: str, strict: bool) -> list[PciDevice]:
    base = os.path.join(root, "bus/pci/devices")
    if not os.path.isdir(base):
        return []
    out = []
    for name in sorted(os.listdir(base)):
        entry = os.path.join(base, name)
        if not BDF_RE.match(name):
            if strict:
                raise TopologyError(f"{entry}: not a PCI address")
            continue
        if not os.path.isdir(entry):
            raise TopologyError(f"{entry}: not a directory (dangling link?)")
        bus_id = normalize_bus_id(name)
        vendor = _hex(os.path.join(entry, "vendor"), strict)
        cls = _hex(os.path.join(entry, "class"), strict)
        if vendor is None or cls is None:
            continue
        dev = _hex(os.path.join(entry, "device"), False) or 0
        local = _cpulist(os.path.join(entry, "local_cpulist")) or []
        out.append(PciDevice(bus_id, vendor, dev, cls, _numa_of(os.path.join(entry, "numa_node")),
                             local, _pci_path(base, entry, bus_id)))
    return out


def _siblings(root: str) -> dict[int, tuple[int, ...]]:
    base = os.path.join(root, "devices/system/cpu")
    out: dict[int, tuple[int, ...]] = {}
    if not os.path.isdir(base):
        return out
    for name in os.listdir(base):
        m = re.fullmatch(r"cpu(\d+)", name)
        if m:
            sib = _cpulist(os.path.join(base, name, "topology/thread_siblings_list"))
            if sib:
                out[int(m.group(1))] = tuple(sib)
    return out


def _extra_links(root: str) -> dict[tuple[str, str], Link]:
    path = os.path.join(root, "kog-links.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        out = {}
        for item in doc["links"]:
            a, b = normalize_bus_id(item["a"]), normalize_bus_id(item["b"])
            kind = str(item["kind"]).upper()
            width = item.get("width")
            out[(min(a, b), max(a, b))] = Link(kind, int(width) if width else None, "kog-links.json")
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise TopologyError(f"{path}: malformed ({type(e).__name__}: {e})") from None


def read_sysfs(root: str = "/sys", strict: bool = True) -> SysfsInfo:
    """Read the tree at `root`. strict: a recorded tree, so a missing or bad file is an error."""
    notes: list[str] = []
    if not os.path.isdir(root):
        raise TopologyError(f"sysfs root {root}: no such directory")
    has_pci = os.path.isdir(os.path.join(root, "bus/pci/devices"))
    has_node = os.path.isdir(os.path.join(root, "devices/system/node"))
    if not has_pci and not has_node:
        raise TopologyError(f"sysfs root {root}: neither bus/pci/devices nor devices/system/node found")
    nodes = _numa_nodes(root)
    devices = _devices(root, strict)
    online = _cpulist(os.path.join(root, "devices/system/cpu/online"))
    cpus = online if online is not None else sorted({c for n in nodes for c in n.cpus})
    if not cpus:
        cpus = sorted({c for d in devices for c in d.local_cpus})
        if cpus:
            notes.append("no CPU list in sysfs; CPUs taken from the devices' local_cpulist")
    if not cpus:
        raise TopologyError(f"sysfs root {root}: no CPUs found (devices/system/node/node*/cpulist)")
    if not nodes:
        notes.append("no NUMA nodes in sysfs; all CPUs taken as node 0")
        nodes = [NumaNode(0, list(cpus))]
    return SysfsInfo(root, cpus, nodes, devices, _siblings(root), _extra_links(root), notes)
