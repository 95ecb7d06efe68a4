"""The placement plan: which GPU, CPU cores and NUMA node each of N ranks gets (docs/topology.md).

Policy in short:
1. Spread over physical GPUs first (each package brings its own HBM bandwidth, which is what
   batch-1 decoding is bound by); inside a package spread over IODs before doubling up on one.
2. Choose the packages greedily so the chosen set has the best worst link (NV/xGMI before PCIe),
   preferring the NUMA nodes already in use.
3. Number ranks by NUMA node, then by package, then partition: ranks on one node are consecutive
   (ranks 0-3 on NUMA 0 on an HGX node) and partitions of one package are neighbours (PKG links).
4. Split the CPUs local to a GPU (its NUMA node) among the ranks placed there, in whole physical
   cores, contiguous blocks; memory goes to the GPU's NUMA node.
With no GPU, ranks are spread over NUMA nodes the same way and get CPU cores only.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .model import Gpu, Machine, TopologyError, format_cpulist

POLICY = ("spread over packages, best links, ranks grouped by NUMA node then package; "
          "node-local cores split in whole cores")


class PlanError(TopologyError):
    """The machine cannot host the requested ranks (e.g. more ranks than GPUs)."""


@dataclass
class PlanEntry:
    rank: int
    gpu: int | None
    bus_id: str | None
    package: int | None
    partition: str | None
    numa: int | None
    cores: list[int]
    link_next: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cores_list"] = format_cpulist(self.cores)
        return d


@dataclass
class Plan:
    nranks: int
    entries: list[PlanEntry]
    policy: str = POLICY
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"nranks": self.nranks, "policy": self.policy, "notes": list(self.notes),
                "ranks": [e.to_dict() for e in self.entries]}


def _numa_key(n: int | None) -> tuple[int, int]:
    return (1, 0) if n is None else (0, n)


def _cost(m: Machine, a: Gpu, b: Gpu) -> tuple[int, int]:
    c = m.link(a.index, b.index).cost()
    if c[0] == 9 and a.numa is not None and a.numa == b.numa:
        return (7, 0)  # unknown path inside one NUMA node: no worse than NODE
    return c


def _spread_order(devs: list[Gpu]) -> list[Gpu]:
    """Partitions of one package, ordered to touch every IOD once before any twice."""
    seen: dict[int, int] = {}
    keyed = []
    for d in sorted(devs, key=lambda g: (g.partition.id if g.partition else 0, g.index)):
        iod = d.partition.iods[0] if d.partition and d.partition.iods else 0
        keyed.append(((seen.get(iod, 0), iod, d.index), d))
        seen[iod] = seen.get(iod, 0) + 1
    return [d for _, d in sorted(keyed, key=lambda t: t[0])]


def _greedy_packages(m: Machine, heads: dict[int, Gpu]) -> list[int]:
    left = sorted(heads, key=lambda p: (_numa_key(heads[p].numa), heads[p].index))
    order = [left.pop(0)]
    while left:
        used_numa = {heads[p].numa for p in order}

        def key(p):
            worst = max(_cost(m, heads[p], heads[q]) for q in order)
            return (worst, heads[p].numa not in used_numa, _cost(m, heads[p], heads[order[-1]]),
                    _numa_key(heads[p].numa), heads[p].index)
        best = min(left, key=key)
        left.remove(best)
        order.append(best)
    return order


def _units(m: Machine, pool: list[int]) -> list[tuple[int, ...]]:
    """Whole physical cores (SMT siblings together) of a CPU pool, in CPU order."""
    pset, seen, out = set(pool), set(), []
    for c in sorted(pool):
        if c in seen:
            continue
        unit = tuple(sorted(set(m.cpu_siblings.get(c, (c,))) & pset)) or (c,)
        seen.update(unit)
        out.append(unit)
    return out


def _split(m: Machine, pool: list[int], k: int) -> list[list[int]]:
    units = _units(m, pool)
    if not units:
        return [[] for _ in range(k)]
    if len(units) < k:
        return [list(units[i % len(units)]) for i in range(k)]
    n = len(units)
    return [sorted(c for u in units[i * n // k:(i + 1) * n // k] for c in u) for i in range(k)]


def _assign_cores(m: Machine, pools: list[list[int]]) -> list[list[int]]:
    """Ranks with the same pool share it; returns the cores of each rank."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, pool in enumerate(pools):
        groups.setdefault(tuple(pool), []).append(r)
    cores: list[list[int]] = [[] for _ in pools]
    for pool, ranks in groups.items():
        for r, cs in zip(ranks, _split(m, list(pool), len(ranks))):
            cores[r] = cs
    return cores


def _entry_numa(m: Machine, gpu_numa: int | None, cores: list[int]) -> int | None:
    if gpu_numa is not None:
        return gpu_numa
    if len(m.numa_nodes) == 1:
        return m.numa_nodes[0].id
    homes = {n.id for n in m.numa_nodes if set(cores) & set(n.cpus)}
    return homes.pop() if len(homes) == 1 else None


def _partition_label(g: Gpu) -> str | None:
    p = g.partition
    if p is None:
        return None
    s = f"{p.compute}/{p.memory} p{p.id}"
    if p.xcds:
        s += f" XCD{format_cpulist(p.xcds)} IOD{format_cpulist(p.iods)}"
    return s


def _plan_gpus(m: Machine, nranks: int) -> Plan:
    if nranks > len(m.gpus):
        n = len(m.gpus)
        raise PlanError(f"{nranks} ranks requested but the machine has {n} GPU{'s' if n != 1 else ''}"
                        " (one rank per GPU)")
    pkgs: dict[int, list[Gpu]] = {}
    for g in m.gpus:
        pkgs.setdefault(g.package, []).append(g)
    pkgs = {p: _spread_order(ds) for p, ds in pkgs.items()}
    order = _greedy_packages(m, {p: ds[0] for p, ds in pkgs.items()})
    if nranks < len(order):
        order = order[:nranks]
    chosen: list[Gpu] = []
    depth = 0
    while len(chosen) < nranks:
        for p in order:
            if depth < len(pkgs[p]) and len(chosen) < nranks:
                chosen.append(pkgs[p][depth])
        depth += 1
    pos = {p: i for i, p in enumerate(order)}
    chosen.sort(key=lambda g: (_numa_key(g.numa), pos[g.package],
                               g.partition.id if g.partition else 0, g.index))
    allowed = set(m.allowed_cpus)
    pools = []
    for g in chosen:
        node = m.node(g.numa)
        pool = [c for c in (g.cpus or (node.cpus if node else [])) if c in allowed]
        pools.append(pool or sorted(allowed))
    cores = _assign_cores(m, pools)
    entries = [PlanEntry(r, g.index, g.bus_id, g.package, _partition_label(g),
                         _entry_numa(m, g.numa, cores[r]), cores[r]) for r, g in enumerate(chosen)]
    if nranks > 1:
        for r, e in enumerate(entries):
            e.link_next = m.link(e.gpu, entries[(r + 1) % nranks].gpu).label
    notes = []
    if any(g.numa is None for g in chosen):
        notes.append("NUMA node of some GPUs unknown: their ranks use the CPUs the device reports")
    return Plan(nranks, entries, notes=notes)


def _plan_cpus(m: Machine, nranks: int) -> Plan:
    allowed = set(m.allowed_cpus)
    nodes = [n for n in m.numa_nodes if set(n.cpus) & allowed] or m.numa_nodes
    counts = {n.id: 0 for n in nodes}
    for r in range(nranks):
        counts[nodes[r % len(nodes)].id] += 1
    pools, numas = [], []
    for n in nodes:
        pool = [c for c in n.cpus if c in allowed] or sorted(allowed)
        pools += [pool] * counts[n.id]
        numas += [n.id] * counts[n.id]
    cores = _assign_cores(m, pools)
    notes = ["no GPU: CPU-only plan"]
    if nranks > len(allowed):
        notes.append(f"{nranks} ranks share {len(allowed)} CPUs")
    return Plan(nranks, [PlanEntry(r, None, None, None, None, numas[r], cores[r])
                         for r in range(nranks)], notes=notes)


def plan(machine: Machine, nranks: int | None = None, use_gpus: bool = True) -> Plan:
    """Place `nranks` ranks (default: one per GPU, or one per NUMA node without GPUs).
    use_gpus=False plans CPU cores only (ranks of the CPU backend on a GPU machine)."""
    gpus = machine.gpus if use_gpus else []
    if nranks is None:
        nranks = len(gpus) or len(machine.numa_nodes) or 1
    if nranks < 1:
        raise PlanError(f"ranks must be at least 1, got {nranks}")
    return _plan_gpus(machine, nranks) if gpus else _plan_cpus(machine, nranks)
