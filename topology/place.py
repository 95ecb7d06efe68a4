"""One call for a rank at start: probe this node, plan its local ranks, bind this one.

Every rank on a node computes the same plan independently (the probe reads only machine facts,
not the rank's own affinity), so no communication is needed.
"""
from __future__ import annotations

import os

from .bind import bind
from .model import TopologyError
from .plan import plan
from .probe import probe

_LOCAL_RANK = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID")
_LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")


def _env_int(names) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v is not None and v.strip().isdigit():
            return int(v)
    return None


def _slurm_local_size() -> int | None:
    """SLURM_TASKS_PER_NODE looks like '4(x2),3'; this node's count is in SLURM_NTASKS_PER_NODE
    when set, else the first group (a good guess on homogeneous jobs)."""
    v = _env_int(["SLURM_NTASKS_PER_NODE"])
    if v is not None:
        return v
    tpn = os.environ.get("SLURM_TASKS_PER_NODE")
    if tpn:
        head = tpn.split(",")[0].split("(")[0]
        return int(head) if head.isdigit() else None
    return None


def place_rank(rank: int, nranks: int, local_rank: int | None = None, mode: str = "cores",
               local_size: int | None = None, sysfs_root: str | None = None,
               use_gpus: bool = True) -> dict:
    """Probe, plan the ranks of this node and bind this rank. Returns what was done:
    {"rank", "local_rank", "local_size", "mode", "gpu", "bus_id", "device", "numa", "cores",
     "partition", "mempolicy", "error"}. Binding problems never raise: they go into "error".
    use_gpus=False: a CPU-backend rank, planned on cores only."""
    if local_rank is None:
        local_rank = _env_int(_LOCAL_RANK)
    if local_rank is None:
        local_rank = rank
    if local_size is None:
        local_size = _env_int(_LOCAL_SIZE) or _slurm_local_size() or nranks
    local_size = max(local_size, local_rank + 1)
    out = {"rank": rank, "local_rank": local_rank, "local_size": local_size, "mode": mode,
           "error": None}
    try:
        m = probe(sysfs_root=sysfs_root)
        p = plan(m, local_size, use_gpus=use_gpus)
        done = bind(p.entries[local_rank], mode, m)
        done.pop("rank", None)
        out.update(done)
    except (TopologyError, OSError) as e:
        out.update({"gpu": None, "cores": None, "numa": None, "error": str(e)})
    return out
