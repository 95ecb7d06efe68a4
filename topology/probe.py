"""Build one `Machine` from every source present: sysfs, NVML, amd-smi. Each source is optional.

Precedence for a fact about a GPU: NVML / amd-smi for names, memory, partitions and GPU-GPU
fabric links; sysfs for NUMA node, local CPUs and the PCIe path. Links, best source first:
same package (PKG), NVML, the tree's kog-links.json, amd-smi xGMI, NVSwitch present (NV),
PCIe path (PIX/PXB/PHB/NODE/SYS), NUMA nodes (SYS when both are known and differ), else "?".
"""
from __future__ import annotations

import os

from .model import Gpu, Link, Machine, NumaNode, TopologyError, parse_cpulist, physical_bus_id
from .probe_amd import AmdInfo, load_amd_smi_json, probe_amd_live
from .probe_nvml import NvmlInfo, probe_nvml
from .probe_sysfs import PciDevice, SysfsInfo, read_sysfs


def mps_running() -> bool:
    """Whether CUDA MPS serves this machine: its control pipe exists (CUDA_MPS_PIPE_DIRECTORY, default
    /tmp/nvidia-mps; also seen from a container that mounts it), or an MPS process runs here. Ranks that
    share a GPU need it: without it their persistent kernels take turns in time slices."""
    if os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control")):
        return True
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().startswith("nvidia-cuda-mps"):   # -control / -server (comm: 15 chars)
                        return True
            except OSError:
                pass
    return False


KNOWN_NAMES = {(0x10DE, 0x2335): "NVIDIA H200", (0x10DE, 0x233B): "NVIDIA H200 NVL",
               (0x10DE, 0x2330): "NVIDIA H100 80GB HBM3", (0x10DE, 0x2331): "NVIDIA H100 PCIe",
               (0x10DE, 0x20B2): "NVIDIA A100-SXM4-80GB", (0x1002, 0x74A1): "AMD Instinct MI300X",
               (0x1002, 0x74A5): "AMD Instinct MI325X"}


def _cgroup_cpus() -> list[int] | None:
    """The CPUs of this process's cgroup v2 cpuset (what a rank may bind to), if readable."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return None
        with open(os.path.join("/sys/fs/cgroup", rel.lstrip("/"), "cpuset.cpus.effective")) as f:
            return parse_cpulist(f.read()) or None
    except (OSError, TopologyError, StopIteration):
        return None


def pcie_link(a: list[str], b: list[str], numa_a, numa_b, one_node: bool) -> Link:
    """Classify the PCIe path between two devices as nvidia-smi topo -m does."""
    if a and b and a[0] == b[0]:
        common = 0
        while common < min(len(a), len(b)) and a[common] == b[common]:
            common += 1
        if common == 1:
            return Link("PHB", None, "sysfs")
        bridges = (len(a) - common - 1) + (len(b) - common - 1)
        return Link("PIX" if bridges <= 2 else "PXB", None, "sysfs")
    if numa_a is not None and numa_b is not None:
        return Link("NODE" if numa_a == numa_b else "SYS", None, "sysfs")
    if one_node:
        return Link("NODE", None, "sysfs")
    return Link("?")


def _sysfs_name(d: PciDevice) -> str:
    return KNOWN_NAMES.get((d.vendor_id, d.device_id),
                           f"{d.vendor.upper()} [{d.vendor_id:04x}:{d.device_id:04x}]")


def _merge_gpus(sfs: SysfsInfo | None, nvml: NvmlInfo | None, amd: AmdInfo | None
                ) -> tuple[list[Gpu], dict[int, int]]:
    """-> GPUs in report order, and amd-smi index -> GPU index."""
    sys_by_phys = {physical_bus_id(d.bus_id): d for d in (sfs.gpus if sfs else [])}
    amd_phys = {physical_bus_id(g.bus_id) for g in (amd.gpus if amd else [])}
    nv_by_bus = {g.bus_id: g for g in (nvml.gpus if nvml else [])}
    out: list[tuple[tuple, Gpu, int | None]] = []
    seen = set()
    for bus, d in sys_by_phys.items():
        if bus in amd_phys:
            continue
        g = Gpu(0, d.vendor, _sysfs_name(d), d.bus_id, d.numa, list(d.local_cpus),
                pci_path=list(d.path), sources=["sysfs"])
        nv = nv_by_bus.get(d.bus_id)
        if nv:
            g.name, g.memory_mb = nv.name, nv.memory_mb
            g.numa = g.numa if g.numa is not None else nv.numa
            g.cpus = g.cpus or nv.cpus
            g.sources.append("nvml")
        seen.add(d.bus_id)
        out.append(((0 if g.vendor == "nvidia" else 2, g.bus_id, 0), g, None))
    for nv in (nvml.gpus if nvml else []):
        if nv.bus_id not in seen:
            out.append(((0, nv.bus_id, 0), Gpu(0, "nvidia", nv.name, nv.bus_id, nv.numa, nv.cpus,
                                               memory_mb=nv.memory_mb, sources=["nvml"]), None))
    for ag in (amd.gpus if amd else []):
        d = sys_by_phys.get(physical_bus_id(ag.bus_id))
        g = Gpu(0, "amd", ag.name, ag.bus_id, d.numa if d else None, list(d.local_cpus) if d else [],
                partition=ag.partition, memory_mb=ag.memory_mb,
                pci_path=list(d.path) if d else [], sources=(["sysfs"] if d else []) + ["amd-smi"])
        if g.numa is None:
            g.numa = ag.numa
        out.append(((1, ag.index, 0), g, ag.index))
    out.sort(key=lambda t: t[0])
    gpus, amd_map, packages = [], {}, {}
    for i, (_, g, aidx) in enumerate(out):
        g.index = i
        g.package = packages.setdefault(physical_bus_id(g.bus_id), len(packages))
        if aidx is not None:
            amd_map[aidx] = i
        gpus.append(g)
    return gpus, amd_map


def _links(gpus: list[Gpu], sfs, nvml, amd, amd_map, one_node: bool) -> dict[tuple[int, int], Link]:
    extra = sfs.extra_links if sfs else {}
    nvswitch = bool(sfs and sfs.nvswitches)
    amd_links = {}
    if amd:
        inv = amd_map
        amd_links = {(min(inv[a], inv[b]), max(inv[a], inv[b])): ln
                     for (a, b), ln in amd.links.items() if a in inv and b in inv}
    links = {}
    for a in gpus:
        for b in gpus[a.index + 1:]:
            key = (a.index, b.index)
            pa, pb = physical_bus_id(a.bus_id), physical_bus_id(b.bus_id)
            pair = (min(a.bus_id, b.bus_id), max(a.bus_id, b.bus_id))
            ppair = (min(pa, pb), max(pa, pb))
            if a.package == b.package:
                ln = Link("PKG", None, "amd-smi" if a.partition else "pci")
            elif nvml and pair in nvml.links:
                ln = nvml.links[pair]
            elif ppair in extra:
                ln = extra[ppair]
            elif key in amd_links:
                ln = amd_links[key]
            elif nvswitch and a.vendor == b.vendor == "nvidia":
                ln = Link("NV", None, "sysfs: NVSwitch present")
            else:
                ln = pcie_link(a.pci_path, b.pci_path, a.numa, b.numa, one_node)
            links[key] = ln
    return links


def probe(sysfs_root: str | None = None, amd_smi_json: str | None = None,
          use_nvml: bool | None = None, use_amd_smi: bool | None = None, nvml_module=None) -> Machine:
    """Probe the machine. sysfs_root: a recorded tree (NVML and live amd-smi then off)."""
    recorded = sysfs_root is not None
    use_nvml = (not recorded) if use_nvml is None else use_nvml
    use_amd_smi = (not recorded and amd_smi_json is None) if use_amd_smi is None else use_amd_smi
    sources, notes = [], []
    sfs = None
    try:
        sfs = read_sysfs(sysfs_root or "/sys", strict=recorded)
        sources.append(f"sysfs:{sfs.root}")
        notes += sfs.notes
    except TopologyError as e:
        if recorded:
            raise
        notes.append(f"sysfs unusable: {e}")
    nvml = probe_nvml(nvml_module) if use_nvml else None
    if use_nvml and nvml is None:
        notes.append("NVML not available (nvidia-ml-py missing or no NVIDIA driver)")
    if nvml is not None:
        sources.append("nvml" + (f" (driver {nvml.driver})" if nvml.driver else ""))
    amd = load_amd_smi_json(amd_smi_json) if amd_smi_json else (probe_amd_live() if use_amd_smi else None)
    if amd is not None:
        sources.append(f"amd-smi:{amd_smi_json}" if amd_smi_json else "amd-smi")
    if sfs is not None:
        cpus, nodes = sfs.cpus, sfs.numa_nodes
    else:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            list(range(os.cpu_count() or 1))
        nodes = [NumaNode(0, list(cpus))]
    allowed = cpus
    if not recorded:
        cg = _cgroup_cpus()
        if cg:
            allowed = sorted(set(cpus) & set(cg)) or cpus
    gpus, amd_map = _merge_gpus(sfs, nvml, amd)
    for g in gpus:
        if g.numa is not None and not g.cpus:
            node = next((n for n in nodes if n.id == g.numa), None)
            g.cpus = list(node.cpus) if node else []
    links = _links(gpus, sfs, nvml, amd, amd_map, len(nodes) == 1)
    return Machine(list(cpus), list(allowed), list(nodes), gpus, links,
                   dict(sfs.cpu_siblings) if sfs else {}, sources, notes)
