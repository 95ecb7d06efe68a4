"""Render a machine and a plan: the readable report of `kog topo` and its JSON twin.

The text follows `nvidia-smi topo -m`: a GPU-by-GPU matrix of link labels with CPU and NUMA
affinity columns, then the legend.
"""
from __future__ import annotations

from .model import LINK_LEGEND, Machine, format_cpulist
from .plan import Plan


def _numa(n) -> str:
    return "N/A" if n is None else str(n)


def _table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def fmt(cells):
        return "  ".join(c.rjust(w[i]) if i in right else c.ljust(w[i])
                         for i, c in enumerate(cells)).rstrip()
    return [fmt(headers), fmt(["-" * x for x in w])] + [fmt(r) for r in rows]


def link_matrix(m: Machine) -> list[list[str]]:
    return [[m.link(a.index, b.index).label for b in m.gpus] for a in m.gpus]


def to_json(m: Machine, p: Plan | None) -> dict:
    return {"machine": m.to_dict(),
            "links": {"gpus": [f"GPU{g.index}" for g in m.gpus], "matrix": link_matrix(m),
                      "sources": [[m.link(a.index, b.index).source for b in m.gpus] for a in m.gpus],
                      "legend": dict(LINK_LEGEND)},
            "partitions": [{"gpu": g.index, "package": g.package, "bus_id": g.bus_id,
                            "compute": g.partition.compute, "memory": g.partition.memory,
                            "partition_id": g.partition.id, "xcds": g.partition.xcds,
                            "iods": g.partition.iods, "compute_units": g.partition.compute_units}
                           for g in m.gpus if g.partition],
            "plan": p.to_dict() if p else None}


def render(m: Machine, p: Plan | None) -> str:
    out = [f"kog topo: {len(m.cpus)} CPUs ({len(m.allowed_cpus)} allowed), "
           f"{len(m.numa_nodes)} NUMA node{'s' if len(m.numa_nodes) != 1 else ''}, "
           f"{len(m.gpus)} GPU{'s' if len(m.gpus) != 1 else ''}",
           f"sources: {', '.join(m.sources) or 'none'}", ""]
    out.append("GPUs")
    if m.gpus:
        rows = [[str(g.index), g.vendor, g.name, g.bus_id, _numa(g.numa),
                 format_cpulist(g.cpus) or "N/A",
                 f"{g.memory_mb} MiB" if g.memory_mb else "N/A", str(g.package)] for g in m.gpus]
        out += _table(["GPU", "Vendor", "Name", "Bus-Id", "NUMA", "CPU Affinity", "Memory", "Pkg"],
                      rows, {0, 4, 7})
    else:
        out.append("No GPU found.")
    out += ["", "NUMA nodes"]
    rows = [[str(n.id), format_cpulist(n.cpus) or "-", str(len(n.cpus)),
             f"{n.mem_mb} MiB" if n.mem_mb else "N/A",
             ",".join(str(g.index) for g in m.gpus if g.numa == n.id) or "-"] for n in m.numa_nodes]
    out += _table(["Node", "CPUs", "Count", "Memory", "GPUs"], rows, {0, 2})
    unknown = [g.index for g in m.gpus if g.numa is None]
    if unknown:
        out.append(f"NUMA node unknown (sysfs -1) for GPU {','.join(map(str, unknown))}")
    if m.gpus:
        out += ["", "Links"]
        mat = link_matrix(m)
        heads = [""] + [f"GPU{g.index}" for g in m.gpus] + ["CPU Affinity", "NUMA Affinity"]
        rows = [[f"GPU{g.index}"] + mat[g.index] + [format_cpulist(g.cpus) or "N/A", _numa(g.numa)]
                for g in m.gpus]
        out += _table(heads, rows)[0:1] + _table(heads, rows)[2:]
        out += ["", "Legend:", ""]
        out += [f"  {k:<4} = {v}" for k, v in LINK_LEGEND]
    parts = [g for g in m.gpus if g.partition]
    if parts:
        out += ["", "Partitions"]
        rows = [[str(g.index), str(g.package), g.bus_id, g.partition.compute, g.partition.memory,
                 str(g.partition.id), format_cpulist(g.partition.xcds) or "?",
                 format_cpulist(g.partition.iods) or "?", str(g.partition.compute_units or "?")]
                for g in parts]
        out += _table(["GPU", "Pkg", "Bus-Id", "Compute", "Memory", "Part", "XCDs", "IODs", "CUs"],
                      rows, {0, 1, 5, 8})
    if p is not None:
        out += ["", f"Plan: {p.nranks} rank{'s' if p.nranks != 1 else ''} ({p.policy})"]
        rows = [[str(e.rank), "-" if e.gpu is None else str(e.gpu), e.bus_id or "-",
                 e.partition or "-", _numa(e.numa), format_cpulist(e.cores) or "-",
                 e.link_next or "-"] for e in p.entries]
        out += _table(["Rank", "GPU", "Bus-Id", "Partition", "NUMA", "Cores", "Next"], rows, {0, 1, 4})
        if p.nranks > 1 and p.entries[0].gpu is not None:
            out.append("Next: the link from each rank to the next one (ring order, last to first).")
        out += [f"note: {n}" for n in p.notes]
    out += [f"note: {n}" for n in m.notes]
    return "\n".join(out) + "\n"
