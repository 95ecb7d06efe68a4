"""Apply a plan entry to the calling process: CPU affinity, memory policy, and the GPU to use.

mode "none": nothing is changed (the GPU is still reported).
mode "cores": affinity to the entry's cores; memory preferred on its NUMA node.
mode "numa": affinity to every allowed CPU of its NUMA node; memory preferred on that node.
The memory policy goes through libnuma (ctypes) when it is installed and NUMA is available, and is
skipped silently otherwise. CUDA_VISIBLE_DEVICES is left alone (CUDA IPC between ranks needs the
peers visible); the result carries the device ordinal to open instead.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

from .model import Machine, format_cpulist
from .plan import PlanEntry

MODES = ("none", "cores", "numa")


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def set_affinity(cpus: list[int]) -> list[int]:
    """Pin every thread of this process to `cpus`; returns the affinity read back from the OS."""
    want = set(cpus)
    try:
        os.sched_setaffinity(0, want)
    except OSError:
        # Not all planned CPUs are allowed here (cpuset): keep the allowed part, if any.
        usable = want & set(os.sched_getaffinity(0))
        if not usable:
            return sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, usable)
        want = usable
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, want)
        except OSError:
            pass  # a thread that ended meanwhile
    return sorted(os.sched_getaffinity(0))


def set_preferred_node(node: int) -> str:
    """Prefer memory from `node` for this thread and its future threads, through libnuma."""
    name = ctypes.util.find_library("numa")
    if not name:
        return "skipped (libnuma not installed)"
    try:
        lib = ctypes.CDLL(name)
        if lib.numa_available() < 0:
            return "skipped (NUMA not available)"
        if node > lib.numa_max_node():
            return f"skipped (node {node} not present)"
        lib.numa_set_preferred(ctypes.c_int(node))
        return f"preferred node {node}"
    except (OSError, AttributeError) as e:
        return f"skipped ({e})"


def cuda_ordinal(machine: Machine | None, gpu: int | None) -> int | None:
    """The device number to open for machine GPU `gpu`, given CUDA/HIP_VISIBLE_DEVICES if set.

    Devices of the GPU's vendor are counted in PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID).
    """
    if machine is None or gpu is None:
        return gpu
    g = machine.gpus[gpu]
    same = [x for x in machine.gpus if x.vendor == g.vendor]
    ordinal = same.index(g)
    var = "CUDA_VISIBLE_DEVICES" if g.vendor == "nvidia" else "HIP_VISIBLE_DEVICES"
    vis = os.environ.get(var)
    if vis is None:
        return ordinal
    items = [v.strip() for v in vis.split(",") if v.strip()]
    if all(v.isdigit() for v in items):
        return items.index(str(ordinal)) if str(ordinal) in items else None
    return None  # UUIDs or MIG names: the caller must resolve


def bind(entry: PlanEntry, mode: str = "cores", machine: Machine | None = None) -> dict:
    """Bind the calling process as `entry` says; returns what was done, for the rank's log."""
    if mode not in MODES:
        raise ValueError(f"bind mode must be one of {', '.join(MODES)}, got {mode!r}")
    if entry.gpu is not None:
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    done = {"rank": entry.rank, "mode": mode, "gpu": entry.gpu, "bus_id": entry.bus_id,
            "device": cuda_ordinal(machine, entry.gpu), "numa": entry.numa,
            "partition": entry.partition, "mempolicy": "unchanged"}
    if mode == "none":
        done["cores"] = format_cpulist(os.sched_getaffinity(0))
        return done
    cpus = list(entry.cores)
    if mode == "numa" and entry.numa is not None and machine is not None:
        node = machine.node(entry.numa)
        allowed = set(machine.allowed_cpus)
        cpus = [c for c in (node.cpus if node else []) if c in allowed] or cpus
    done["cores"] = format_cpulist(set_affinity(cpus)) if cpus else \
        format_cpulist(os.sched_getaffinity(0))
    if entry.numa is not None:
        done["mempolicy"] = set_preferred_node(entry.numa)
    return done
