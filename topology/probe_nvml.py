"""Probe NVIDIA GPUs through NVML (nvidia-ml-py's `pynvml`); optional: absent module or driver -> None.

Gives per GPU: name, PCI bus id, memory, NUMA node, CPU affinity; per pair: the PCIe common
ancestor (PIX..SYS) and NVLink counts, direct or through NVSwitches, as `nvidia-smi topo -m` shows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .model import Link, normalize_bus_id

# nvmlDeviceGetTopologyCommonAncestor levels -> nvidia-smi topo -m labels
_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


@dataclass
class NvmlGpu:
    bus_id: str
    name: str
    memory_mb: int | None = None
    numa: int | None = None
    cpus: list[int] = field(default_factory=list)


@dataclass
class NvmlInfo:
    gpus: list[NvmlGpu]
    links: dict[tuple[str, str], Link]
    driver: str = ""


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _mask_to_cpus(words) -> list[int]:
    out = []
    for w, word in enumerate(words):
        for bit in range(64):
            if int(word) >> bit & 1:
                out.append(w * 64 + bit)
    return out


def _try(fn, *args, default=None):
    try:
        return fn(*args)
    except Exception:  # NVMLError and friends: the field is simply unknown
        return default


def _nvlinks(nv, handle, max_links: int) -> tuple[dict[str, int], int]:
    """Active links of one GPU: counts per remote GPU bus id, and the count to NVSwitches."""
    to_gpu: dict[str, int] = {}
    to_switch = 0
    for link in range(max_links):
        if _try(nv.nvmlDeviceGetNvLinkState, handle, link, default=0) != 1:
            continue
        kind = _try(nv.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link, default=0)
        if kind == getattr(nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2):
            to_switch += 1
            continue
        get_remote = getattr(nv, "nvmlDeviceGetNvLinkRemotePciInfo_v2", None) or \
            getattr(nv, "nvmlDeviceGetNvLinkRemotePciInfo", None)
        pci = _try(get_remote, handle, link) if get_remote else None
        if pci is None:
            continue
        bus = normalize_bus_id(_text(pci.busId))
        to_gpu[bus] = to_gpu.get(bus, 0) + 1
    return to_gpu, to_switch


def probe_nvml(nv=None) -> NvmlInfo | None:
    """Query NVML; `nv` is the pynvml module (tests pass a fake). None when NVML is unusable."""
    if nv is None:
        try:
            import pynvml as nv  # type: ignore
        except ImportError:
            return None
    try:
        nv.nvmlInit()
    except Exception:
        return None
    try:
        count = nv.nvmlDeviceGetCount()
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus, nvl = [], []
        ncpu_words = 64  # up to 4096 CPUs
        max_links = int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))
        for h in handles:
            bus = normalize_bus_id(_text(nv.nvmlDeviceGetPciInfo(h).busId))
            mem = _try(nv.nvmlDeviceGetMemoryInfo, h)
            numa = _try(nv.nvmlDeviceGetNumaNodeId, h) if hasattr(nv, "nvmlDeviceGetNumaNodeId") else None
            mask = _try(nv.nvmlDeviceGetCpuAffinity, h, ncpu_words, default=[])
            gpus.append(NvmlGpu(bus, _text(_try(nv.nvmlDeviceGetName, h, default="NVIDIA GPU")),
                                int(mem.total) // (1 << 20) if mem is not None else None,
                                numa if isinstance(numa, int) and numa >= 0 else None,
                                _mask_to_cpus(mask or [])))
            nvl.append(_nvlinks(nv, h, max_links))
        links: dict[tuple[str, str], Link] = {}
        for i in range(count):
            for j in range(i + 1, count):
                a, b = gpus[i].bus_id, gpus[j].bus_id
                key = (min(a, b), max(a, b))
                width = nvl[i][0].get(b, 0)
                if nvl[i][1] and nvl[j][1]:
                    width += min(nvl[i][1], nvl[j][1])
                if width:
                    links[key] = Link("NV", width, "nvml")
                    continue
                level = _try(nv.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
                if level in _LEVELS:
                    links[key] = Link(_LEVELS[level], None, "nvml")
        driver = _text(_try(nv.nvmlSystemGetDriverVersion, default=""))
        return NvmlInfo(gpus, links, driver)
    except Exception:  # a driver that fails midway: the source is optional
        return None
    finally:
        _try(nv.nvmlShutdown)
