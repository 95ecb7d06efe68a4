"""The machine model: CPUs, NUMA nodes, GPUs (with partitions) and the links between GPUs.

Everything the probes learn ends up in a `Machine`; the planner and the report read only this.
A NUMA node that the OS reports as -1 is stored as None ("unknown"), never as node -1.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field


class TopologyError(Exception):
    """A probe input (sysfs tree, amd-smi JSON) is missing or malformed; the message is one line."""


# Link kinds, best first.  The order is the planner's preference; the legend is the report's.
LINK_LEGEND = [
    ("X", "Self"),
    ("PKG", "Partitions of the same physical GPU package (on-package Infinity Fabric)"),
    ("NV#", "Connection traversing a bonded set of # NVLinks (NV: NVSwitch seen, link count unknown)"),
    ("XGMI", "Connection traversing AMD xGMI (Infinity Fabric) links"),
    ("PIX", "Connection traversing at most a single PCIe bridge"),
    ("PXB", "Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)"),
    ("PHB", "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)"),
    ("NODE", "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node"),
    ("SYS", "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)"),
    ("?", "Unknown (no source could tell)"),
]
_RANK = {"X": 0, "PKG": 1, "NV": 2, "XGMI": 3, "PIX": 4, "PXB": 5, "PHB": 6, "NODE": 7, "SYS": 8, "?": 9}


@dataclass(frozen=True)
class Link:
    """How two GPUs reach each other. kind is a key of the legend ("NV" carries width = link count)."""
    kind: str
    width: int | None = None
    source: str = ""

    @property
    def label(self) -> str:
        if self.kind == "NV":
            return f"NV{self.width}" if self.width else "NV"
        return self.kind

    def cost(self) -> tuple[int, int]:
        """Smaller is better: the kind's rank, then more links first."""
        return (_RANK.get(self.kind, 9), -(self.width or 0))


UNKNOWN_LINK = Link("?")


@dataclass
class NumaNode:
    id: int
    cpus: list[int]
    mem_mb: int | None = None


@dataclass
class Partition:
    """A compute partition of a physical GPU (MI300X: SPX/DPX/QPX/CPX with NPS1/NPS4 memory)."""
    compute: str
    memory: str
    id: int
    xcds: list[int] = field(default_factory=list)
    iods: list[int] = field(default_factory=list)
    compute_units: int | None = None


@dataclass
class Gpu:
    """One schedulable GPU: a whole device, or one partition of it (then `package` groups them)."""
    index: int
    vendor: str                      # "nvidia" | "amd" | "other"
    name: str
    bus_id: str                      # "0000:18:00.0"
    numa: int | None = None          # None = unknown (sysfs -1)
    cpus: list[int] = field(default_factory=list)   # local CPUs as the device reports them
    package: int = 0                 # index of the physical GPU this device lives on
    partition: Partition | None = None
    memory_mb: int | None = None
    pci_path: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


@dataclass
class Machine:
    cpus: list[int]                  # online CPUs
    allowed_cpus: list[int]          # CPUs this process may use (cgroup cpuset)
    numa_nodes: list[NumaNode]
    gpus: list[Gpu]
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    cpu_siblings: dict[int, tuple[int, ...]] = field(default_factory=dict)  # SMT threads of a core
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def link(self, a: int, b: int) -> Link:
        if a == b:
            return Link("X")
        return self.links.get((min(a, b), max(a, b)), UNKNOWN_LINK)

    def node(self, nid: int | None) -> NumaNode | None:
        return next((n for n in self.numa_nodes if n.id == nid), None)

    def to_dict(self) -> dict:
        return {
            "cpus": format_cpulist(self.cpus),
            "cpu_count": len(self.cpus),
            "allowed_cpus": format_cpulist(self.allowed_cpus),
            "numa_nodes": [{"id": n.id, "cpus": format_cpulist(n.cpus), "cpu_count": len(n.cpus),
                            "mem_mb": n.mem_mb,
                            "gpus": [g.index for g in self.gpus if g.numa == n.id]}
                           for n in self.numa_nodes],
            "gpus": [_gpu_dict(g) for g in self.gpus],
            "sources": list(self.sources),
            "notes": list(self.notes),
        }


def _gpu_dict(g: Gpu) -> dict:
    d = asdict(g)
    d["cpus"] = format_cpulist(g.cpus)
    return d


def parse_cpulist(text: str, what: str = "cpulist") -> list[int]:
    """'0-3,8,10-11' -> [0,1,2,3,8,10,11]; '' -> []. Raises TopologyError on garbage."""
    out: set[int] = set()
    text = text.strip()
    if not text:
        return []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
                if lo < 0 or hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                v = int(part)
                if v < 0:
                    raise ValueError
                out.add(v)
        except ValueError:
            raise TopologyError(f"malformed {what}: {text!r}") from None
    return sorted(out)


def format_cpulist(cpus) -> str:
    """[0,1,2,3,8] -> '0-3,8' (the kernel's notation)."""
    cpus = sorted(set(cpus))
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def normalize_bus_id(bus_id: str) -> str:
    """NVML's '00000000:18:00.0' and amd-smi's '0000:18:00.0' -> '0000:18:00.0' (lower case)."""
    s = bus_id.strip().lower()
    if s.count(":") == 1:
        s = "0000:" + s
    m = re.fullmatch(r"([0-9a-f]{1,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", s)
    if not m:
        raise ValueError(f"not a PCI address: {bus_id!r}")
    return f"{int(m.group(1), 16):04x}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


def physical_bus_id(bus_id: str) -> str:
    """The PCI function 0 address of a device: partitions reported as '...:00.3' map to '...:00.0'."""
    return bus_id.rsplit(".", 1)[0] + ".0"
