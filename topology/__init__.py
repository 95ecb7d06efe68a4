"""topology: probe the machine (sysfs, NVML, amd-smi), plan rank placement, bind each rank.

    m = topology.probe()                 # Machine: CPUs, NUMA nodes, GPUs, links, partitions
    p = topology.plan(m, nranks)         # Plan: rank -> GPU, cores, NUMA node
    topology.bind(p.entries[r], "cores", m)
    topology.place_rank(rank, nranks, local_rank, mode)   # all three, for a rank at start
See docs/topology.md for the placement policy.
"""
from .bind import MODES, bind
from .model import Gpu, Link, Machine, NumaNode, Partition, TopologyError
from .place import place_rank
from .plan import Plan, PlanEntry, PlanError, plan
from .probe import probe

__all__ = ["probe", "plan", "bind", "place_rank", "MODES", "Machine", "Gpu", "Link", "NumaNode",
           "Partition", "Plan", "PlanEntry", "PlanError", "TopologyError"]
