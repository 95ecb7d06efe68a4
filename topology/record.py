"""`kog topo --record DIR`: write this machine as a recorded tree, in the layout `--sysfs-root` reads.

Copied from the sysfs root (/sys, or a recorded tree), byte for byte, and nothing else:
  devices/system/node/node*/cpulist, devices/system/node/node*/meminfo (its MemTotal line only)
  devices/system/cpu/online, devices/system/cpu/cpu*/topology/thread_siblings_list
  bus/pci/devices/*/{vendor,device,class,numa_node,local_cpulist}; an entry that is a symlink
      (as in /sys) stays a relative symlink to its own directory under devices/pci*/..., so the
      recording keeps the PCIe path; a plain directory stays a plain directory
Written:
  kog-links.json  the GPU pair links the probe took from NVML (NVLink counts, else its PCIe level)
                  or from the source tree's kog-links.json; absent when there are none
  recorded.json   for reference only (the probe does not read it): `kog topo --json` of the live
                  probe, `uname -srvm` (the host name is left out), the date and the source root
The tree is built beside DIR and renamed into place: a failed recording leaves nothing behind.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import tempfile

from .model import Machine, TopologyError, physical_bus_id
from .plan import plan
from .probe import probe
from .probe_sysfs import BDF_RE
from .report import to_json

PCI_FILES = ("vendor", "device", "class", "numa_node", "local_cpulist")
NODE, CPU, PCI = "devices/system/node", "devices/system/cpu", "bus/pci/devices"
LINK_SOURCES = ("nvml", "kog-links.json")


def sysfs_view(m: Machine) -> dict:
    """The facts a recorded tree gives back: compare a live probe with the probe of its recording."""
    return {"cpus": list(m.cpus),
            "numa_nodes": [(n.id, list(n.cpus), n.mem_mb) for n in m.numa_nodes],
            "cpu_siblings": dict(sorted(m.cpu_siblings.items())),
            "gpus": [(g.bus_id, g.vendor, g.numa, list(g.cpus), g.package, list(g.pci_path))
                     for g in m.gpus],
            "links": [[m.link(a.index, b.index).label for b in m.gpus] for a in m.gpus]}


def differences(live: Machine, recorded: Machine) -> list[str]:
    a, b = sysfs_view(live), sysfs_view(recorded)
    return [f"{k}: live {a[k]} != recorded {b[k]}" for k in a if a[k] != b[k]]


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as e:
        raise TopologyError(f"cannot read {path}: {e.strerror}") from None


def _ls(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _check_dest(dest: str) -> str:
    """-> the parent directory, where the tree is built; raises when DIR cannot take a recording."""
    try:
        if os.path.lexists(dest):
            if os.path.islink(dest) or not os.path.isdir(dest):
                raise TopologyError(f"--record {dest}: exists and is not a directory")
            if os.listdir(dest):
                raise TopologyError(f"--record {dest}: exists and is not empty")
    except OSError as e:
        raise TopologyError(f"--record {dest}: {e.strerror}") from None
    parent = os.path.dirname(os.path.abspath(dest))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise TopologyError(f"--record {dest}: cannot create {parent}: {e.strerror}") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TopologyError(f"--record {dest}: {parent} is not writable")
    return parent


class _Copier:
    def __init__(self, src: str, out: str):
        self.src, self.out, self.files = src, out, 0

    def write(self, rel: str, data: bytes) -> None:
        path = os.path.join(self.out, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        self.files += 1

    def copy(self, rel: str, to: str | None = None, only: bytes | None = None) -> None:
        data = _read(os.path.join(self.src, rel))
        if data is not None:
            if only is not None:
                data = b"".join(ln for ln in data.splitlines(keepends=True) if only in ln)
            self.write(to or rel, data)

    def cpus_and_nodes(self) -> None:
        for name in _ls(os.path.join(self.src, NODE)):
            if re.fullmatch(r"node\d+", name):
                self.copy(f"{NODE}/{name}/cpulist")
                self.copy(f"{NODE}/{name}/meminfo", only=b"MemTotal:")
        self.copy(f"{CPU}/online")
        for name in _ls(os.path.join(self.src, CPU)):
            if re.fullmatch(r"cpu\d+", name):
                self.copy(f"{CPU}/{name}/topology/thread_siblings_list")

    def pci(self) -> int:
        base, n = os.path.join(self.src, PCI), 0
        for name in _ls(base):
            entry = os.path.join(base, name)
            if not BDF_RE.match(name) or not all(os.path.exists(os.path.join(entry, f))
                                                 for f in ("vendor", "class")):
                continue                      # the probe skips these too
            home = f"{PCI}/{name}"
            if os.path.islink(entry):         # "../../../devices/pci0000:00/0000:00:01.0/..."
                real = os.path.normpath(os.path.join(base, os.readlink(entry)))
                home = os.path.relpath(real, self.src)
                if not home.startswith("devices/"):
                    raise TopologyError(f"{entry}: links outside {self.src}/devices")
                link = os.path.join(self.out, PCI, name)
                os.makedirs(os.path.dirname(link), exist_ok=True)
                os.symlink(os.path.relpath(os.path.join(self.out, home), os.path.dirname(link)), link)
            os.makedirs(os.path.join(self.out, home), exist_ok=True)
            for f in PCI_FILES:
                self.copy(f"{PCI}/{name}/{f}", to=f"{home}/{f}")
            n += 1
        return n


def _links_doc(m: Machine) -> dict | None:
    links = []
    for (a, b), ln in sorted(m.links.items()):
        if ln.source in LINK_SOURCES:
            item = {"a": physical_bus_id(m.gpus[a].bus_id), "b": physical_bus_id(m.gpus[b].bus_id),
                    "kind": ln.kind}
            links.append(dict(item, width=ln.width) if ln.width else item)
    if not links:
        return None
    return {"comment": "GPU links as the live probe saw them (NVML, or the source tree's "
                       "kog-links.json); written by kog topo --record", "links": links}


def record(dest: str, sysfs_root: str | None = None, use_nvml: bool | None = None,
           nvml_module=None) -> dict:
    """Record the machine whose sysfs is `sysfs_root` (default /sys) into the new directory `dest`.

    use_nvml / nvml_module as for probe(): NVML is queried by default only for the live /sys.
    -> {"dest", "files", "pci_devices", "gpus", "links", "differences"}; differences lists the
    facts of sysfs_view() where probing the recording disagrees with the live probe (empty: none).
    """
    src = sysfs_root or "/sys"
    parent = _check_dest(dest)
    live = probe(sysfs_root=sysfs_root, use_nvml=use_nvml, nvml_module=nvml_module)
    bad = [n for n in live.notes if n.startswith("sysfs unusable")]
    if bad:
        raise TopologyError(f"--record: {bad[0]}")
    try:
        p = plan(live, None)
    except TopologyError:
        p = None
    u = os.uname()
    meta = {"comment": "for reference only: kog topo --sysfs-root does not read this file",
            "recorded_by": "kog topo --record", "source": os.path.abspath(src),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "uname": f"{u.sysname} {u.release} {u.version} {u.machine}",
            "kog_topo_json": to_json(live, p)}
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix=".kog-record-", dir=parent)
        cp = _Copier(src, tmp)
        cp.cpus_and_nodes()
        npci = cp.pci()
        links = _links_doc(live)
        if links:
            cp.write("kog-links.json", (json.dumps(links, indent=1) + "\n").encode())
        cp.write("recorded.json", (json.dumps(meta, indent=1) + "\n").encode())
        diffs = differences(live, probe(sysfs_root=tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        os.replace(tmp, dest)             # an existing empty DIR is replaced
        tmp = None
    except OSError as e:
        raise TopologyError(f"--record {dest}: {e.strerror or e}"
                            + (f" ({e.filename})" if e.filename else "")) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"dest": dest, "files": cp.files, "pci_devices": npci, "gpus": len(live.gpus),
            "links": len(links["links"]) if links else 0, "differences": diffs}
