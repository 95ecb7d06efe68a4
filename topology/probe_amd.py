"""Probe AMD GPUs from `amd-smi` JSON: the live tool when installed, or a recorded file.

A recorded file (`kog topo --amd-smi-json FILE`) is either one JSON object bundling the outputs
    {"static": <amd-smi static --json>, "topology": <amd-smi topology --json>,
     "partition": <amd-smi partition --json, optional>}
or the bare output of one of those commands (a list; told apart by its keys).
From `static` per GPU: asic.market_name, bus.bdf, numa.node, vram.size, asic.num_compute_units and
partition.{compute_partition|accelerator_partition, memory_partition, partition_id}.
From `topology`: links[].{gpu, link_type, num_hops, weight}.
In CPX mode MI300X shows 8 GPUs per physical device; they are grouped by their PCI device address.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field

from .model import Link, Partition, TopologyError, normalize_bus_id, physical_bus_id

# XCDs and IODs per package, by product (MI300X: 8 XCDs on 4 IODs, two per IOD).
CHIPLETS = {"MI300X": (8, 4), "MI325X": (8, 4), "MI308X": (4, 4), "MI300A": (6, 3),
            "MI350X": (8, 2), "MI355X": (8, 2)}
PARTS_PER_MODE = {"SPX": 1, "DPX": 2, "TPX": 3, "QPX": 4, "CPX": 8}


@dataclass
class AmdGpu:
    index: int
    bus_id: str
    name: str
    numa: int | None = None
    memory_mb: int | None = None
    compute_units: int | None = None
    partition: Partition | None = None


@dataclass
class AmdInfo:
    gpus: list[AmdGpu]
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    source: str = "amd-smi"


def _na(v):
    return None if v is None or (isinstance(v, str) and v.strip().upper() in ("N/A", "NA", "")) else v


def _int(v) -> int | None:
    v = _na(v)
    if v is None:
        return None
    if isinstance(v, dict):
        return _int(v.get("value"))
    try:
        return int(str(v).split()[0], 0)
    except ValueError:
        return None


def _unwrap(doc):
    if isinstance(doc, dict) and len(doc) == 1 and isinstance(next(iter(doc.values())), list):
        return next(iter(doc.values()))       # {"gpu_data": [...]} envelopes of newer releases
    return doc


def _split(doc, where: str) -> tuple[list, list, list]:
    """-> (static entries, topology entries, partition entries)"""
    if isinstance(doc, dict) and any(k in doc for k in ("static", "topology", "partition")):
        parts = [_unwrap(doc.get(k)) or [] for k in ("static", "topology", "partition")]
        for k, p in zip(("static", "topology", "partition"), parts):
            if not isinstance(p, list) or not all(isinstance(e, dict) for e in p):
                raise TopologyError(f"{where}: '{k}' is not a list of GPU objects")
        return parts[0], parts[1], parts[2]
    doc = _unwrap(doc)
    if not isinstance(doc, list) or not doc or not all(isinstance(e, dict) for e in doc):
        raise TopologyError(f"{where}: not amd-smi JSON (expected a list of GPU objects or "
                            "an object with 'static'/'topology')")
    if all("links" in e for e in doc):
        return [], doc, []
    if all(("asic" in e or "bus" in e) for e in doc):
        return doc, [], []
    raise TopologyError(f"{where}: not amd-smi static or topology output")


def _bus(bdf, where: str) -> str:
    try:
        return normalize_bus_id(str(bdf))
    except ValueError:
        raise TopologyError(f"{where}: bad PCI address {str(bdf)[:40]!r}") from None


def _partition(entry: dict, extra: dict) -> tuple[str | None, str | None, int | None]:
    p = dict(entry.get("partition") or {})
    p.update({k: v for k, v in extra.items() if _na(v) is not None})
    compute = _na(p.get("compute_partition")) or _na(p.get("accelerator_partition"))
    memory = _na(p.get("memory_partition"))
    return (str(compute).upper() if compute else None, str(memory).upper() if memory else None,
            _int(p.get("partition_id")))


def parse_amd_smi(doc, where: str = "amd-smi") -> AmdInfo:
    static, topo, parts = _split(doc, where)
    part_by_gpu = {e.get("gpu"): e for e in parts if "gpu" in e}
    gpus: list[AmdGpu] = []
    try:
        for e in static:
            idx = _int(e.get("gpu"))
            bdf = _na((e.get("bus") or {}).get("bdf")) or _na(e.get("bdf"))
            if idx is None or not bdf:
                raise TopologyError(f"{where}: static entry without 'gpu' or 'bus.bdf'")
            asic = e.get("asic") or {}
            compute, memory, pid = _partition(e, part_by_gpu.get(e.get("gpu"), {}))
            part = Partition(compute, memory or "?", pid or 0) if compute else None
            gpus.append(AmdGpu(idx, _bus(bdf, where),
                               str(_na(asic.get("market_name")) or "AMD GPU"),
                               _int((e.get("numa") or {}).get("node")),
                               _int(((e.get("vram") or {}).get("size"))),
                               _int(asic.get("num_compute_units")), part))
        if not gpus:  # topology only: GPUs are known by index and bdf
            for e in topo:
                idx, bdf = _int(e.get("gpu")), _na(e.get("bdf"))
                if idx is None or not bdf:
                    raise TopologyError(f"{where}: topology entry without 'gpu' or 'bdf'")
                gpus.append(AmdGpu(idx, _bus(bdf, where), "AMD GPU"))
        links: dict[tuple[int, int], Link] = {}
        for e in topo:
            a = _int(e.get("gpu"))
            for ln in e.get("links") or []:
                b = _int(ln.get("gpu"))
                kind = str(_na(ln.get("link_type")) or "").upper()
                if a is None or b is None or a == b or kind != "XGMI":
                    continue
                links[(min(a, b), max(a, b))] = Link("XGMI", None, "amd-smi")
    except (AttributeError, TypeError, ValueError) as ex:
        raise TopologyError(f"{where}: malformed amd-smi JSON ({type(ex).__name__}: {ex})") from None
    _chiplets(gpus)
    return AmdInfo(sorted(gpus, key=lambda g: g.index), links, where)


def _chiplets(gpus: list[AmdGpu]) -> None:
    """Fill XCD and IOD numbers of each partition from the product's chiplet layout."""
    groups: dict[str, list[AmdGpu]] = {}
    for g in gpus:
        groups.setdefault(physical_bus_id(g.bus_id), []).append(g)
    for members in groups.values():
        for g in members:
            p = g.partition
            if p is None:
                continue
            p.compute_units = g.compute_units
            layout = next((v for k, v in CHIPLETS.items() if k in g.name.upper()), None)
            nparts = PARTS_PER_MODE.get(p.compute, len(members))
            if layout is None or layout[0] % nparts:
                continue
            nxcd, niod = layout
            per = nxcd // nparts
            p.xcds = list(range(p.id * per, (p.id + 1) * per))
            p.iods = sorted({x * niod // nxcd for x in p.xcds})


def load_amd_smi_json(path: str) -> AmdInfo:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise TopologyError(f"amd-smi JSON {path}: no such file") from None
    except IsADirectoryError:
        raise TopologyError(f"amd-smi JSON {path}: is a directory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TopologyError(f"amd-smi JSON {path}: cannot read ({e})") from None
    except json.JSONDecodeError as e:
        raise TopologyError(f"amd-smi JSON {path}: invalid JSON at line {e.lineno} column {e.colno}: "
                            f"{e.msg}") from None
    return parse_amd_smi(doc, f"amd-smi JSON {path}")


def probe_amd_live(timeout: float = 20.0) -> AmdInfo | None:
    """Run the installed amd-smi; None when it is absent or fails (the source is optional)."""
    exe = shutil.which("amd-smi")
    if exe is None:
        return None
    doc = {}
    for cmd in ("static", "topology"):
        try:
            r = subprocess.run([exe, cmd, "--json"], capture_output=True, text=True, timeout=timeout)
            if r.returncode == 0:
                doc[cmd] = json.loads(r.stdout)
        except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
            continue
    if "static" not in doc:
        return None
    try:
        return parse_amd_smi(doc, "amd-smi")
    except TopologyError:
        return None
