"""Who is who: rank, size, local rank and the GPU of this process.

The rank layout comes from MPI itself: ``COMM_WORLD`` gives rank and size, and
``COMM_WORLD.Split_type(COMM_TYPE_SHARED)`` groups the ranks that share a node, which gives the
local rank and the number of ranks on this node whatever launched us (mpiexec of MPICH, mpirun of
Open MPI, srun). The launchers' variables (SLURM_*, OMPI_COMM_WORLD_*, PMI_*, MPI_LOCALRANKID) are
only a fallback for a process that has no MPI (mpi4py missing or not initialised).

Ranks of one job must share a node for now (KCCL's transports are intra-node):
``require_single_node`` refuses a job spread over hosts, on every rank at once, with a message
that says so instead of hanging later in a shared-memory handshake.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from kccl import optional
from kccl.mpi_plain import allgather_json


@dataclass(frozen=True)
class RankInfo:
    rank: int
    size: int
    local_rank: int
    local_size: int
    hostname: str
    source: str = "mpi"          # "mpi" or the name of the variables used ("slurm", "ompi", "pmi", "none")

    @property
    def is_root(self) -> bool:
        return self.rank == 0


class MultiNodeError(RuntimeError):
    """The ranks of one job are on more than one host."""


def _mpi():
    """mpi4py's MPI (kccl.optional: MPI_Init happens on first import), or None without a loadable MPI."""
    try:
        return optional.mpi()
    except optional.MpiMissing:
        return None


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for n in names:
        v = env.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return None


def from_env(env: Optional[Mapping[str, str]] = None) -> RankInfo:
    """The rank layout from the launchers' variables alone (the fallback when MPI is absent)."""
    env = os.environ if env is None else env
    host = socket.gethostname()
    # Order: Open MPI (its own launcher, exact), Slurm (srun), then PMI (hydra, srun --mpi=pmi2).
    tables = [
        ("ompi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",),
         ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
        ("slurm", ("SLURM_PROCID",), ("SLURM_NTASKS", "SLURM_NPROCS"),
         ("SLURM_LOCALID",), ("SLURM_NTASKS_PER_NODE",)),
        ("pmi", ("PMI_RANK",), ("PMI_SIZE",),
         ("MPI_LOCALRANKID", "MPICH_LOCALRANKID"), ("MPI_LOCALNRANKS", "MPICH_LOCALNRANKS")),
    ]
    for name, r, s, lr, ls in tables:
        rank = _int(env, *r)
        if rank is None:
            continue
        size = _int(env, *s) or (rank + 1)
        local_rank = _int(env, *lr)
        local_size = _int(env, *ls)
        if local_rank is None:
            # Unknown node layout: assume one node (the only layout we support).
            local_rank = rank
        if local_size is None:
            local_size = size if local_rank == rank else local_rank + 1
        return RankInfo(rank, size, local_rank, local_size, host, name)
    return RankInfo(0, 1, 0, 1, host, "none")


def _layout(comm):
    """(RankInfo, world rank of this node's leader) from MPI; collective over ``comm``."""
    MPI = _mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
        lead = np.array([rank], dtype=np.int64)   # numpy buffers: mpi4py's lowercase calls pickle
        node.Bcast(lead, root=0)
        leader = int(lead[0])
    finally:
        node.Free()
    try:
        host = MPI.Get_processor_name()
    except Exception:  # pragma: no cover
        host = socket.gethostname()
    return RankInfo(rank, size, local_rank, local_size, host, "mpi"), leader


def discover(comm=None) -> RankInfo:
    """Rank, size, local rank, local size and host name of this process.

    With MPI (the normal case) the answer is MPI's own: ``comm`` (default ``COMM_WORLD``) and its
    shared-memory split. Collective over ``comm``: every rank must call it.
    """
    MPI = _mpi()
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return from_env()
    return _layout(MPI.COMM_WORLD if comm is None else comm)[0]


def hosts_of(comm=None) -> list[str]:
    """Host name of every rank, in rank order (collective)."""
    MPI = _mpi()
    if MPI is None or not MPI.Is_initialized():
        return [socket.gethostname()]
    comm = MPI.COMM_WORLD if comm is None else comm
    return allgather_json(comm, MPI.Get_processor_name())


def require_single_node(comm=None) -> RankInfo:
    """Refuse a job whose ranks span nodes, on every rank, with a clear message.

    Collective: every rank calls it and every rank raises ``MultiNodeError`` (no rank is left
    waiting in a later collective). Returns this rank's ``RankInfo`` when all ranks share a node.
    """
    MPI = _mpi()
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        info = from_env()
        if info.local_size < info.size and info.source != "none":
            raise MultiNodeError(_multi_node_message(info.size, None))
        return info
    comm = MPI.COMM_WORLD if comm is None else comm
    info, leader = _layout(comm)
    # One node holds everyone <=> every rank's node holds everyone, so all ranks branch alike.
    if info.local_size == info.size:
        return info
    leaders = allgather_json(comm, [leader, info.hostname])
    nodes: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for r, (ld, host) in enumerate(leaders):
        nodes.setdefault(ld, []).append(r)
        names.setdefault(ld, host)
    where = "; ".join(f"{names[ld]}: ranks {_ranges(rs)}" for ld, rs in sorted(nodes.items()))
    raise MultiNodeError(_multi_node_message(info.size, (len(nodes), where)))


def _multi_node_message(size: int, nodes) -> str:
    what = f"{nodes[0]} nodes ({nodes[1]})" if nodes else "more than one node"
    return (f"the {size} ranks of this job span {what}; kog_dist runs every rank of a job on one "
            "node for now (KCCL's transports are intra-node): start all ranks on one host "
            "(Slurm: --nodes=1)")


def _ranges(rs: list[int]) -> str:
    out, start, prev = [], None, None
    for r in rs:
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def visible_devices(env: Optional[Mapping[str, str]] = None) -> Optional[list[str]]:
    """The entries of CUDA_VISIBLE_DEVICES (None: unset, every device visible)."""
    env = os.environ if env is None else env
    v = env.get("CUDA_VISIBLE_DEVICES")
    if v is None:
        return None
    v = v.strip()
    if not v or v == "NoDevFiles":
        return []
    out = []
    for item in v.split(","):
        item = item.strip()
        if not item:
            continue
        if item.lstrip("-").isdigit() and int(item) < 0:
            break  # CUDA stops at the first invalid (negative) index
        out.append(item)
    return out


def gpu_for_local_rank(local_rank: int, num_devices: Optional[int] = None,
                       env: Optional[Mapping[str, str]] = None) -> int:
    """The CUDA device ordinal (as this process sees devices) for ``local_rank``.

    With CUDA_VISIBLE_DEVICES set (Slurm's --gpus-per-task, a user's mask) the process sees only
    those devices, renumbered from 0:
    - one visible device: it is ours (Slurm gave every task its own GPU) -> 0;
    - several: local rank i takes the i-th visible one -> i.
    Without it, local rank i takes device i. ``num_devices`` (when known) is checked.
    Raises ValueError when there are fewer devices than local ranks need.
    """
    if local_rank < 0:
        raise ValueError(f"local rank {local_rank} < 0")
    vis = visible_devices(env)
    if vis is not None:
        if len(vis) == 0:
            raise ValueError("CUDA_VISIBLE_DEVICES hides every GPU from this rank")
        if len(vis) == 1:
            return 0
        if local_rank >= len(vis):
            raise ValueError(
                f"local rank {local_rank} needs a GPU but CUDA_VISIBLE_DEVICES={','.join(vis)} "
                f"shows only {len(vis)}: start at most {len(vis)} ranks on this node")
        return local_rank
    if num_devices is not None and local_rank >= num_devices:
        raise ValueError(f"local rank {local_rank} needs a GPU but this node has {num_devices}: "
                         f"start at most {num_devices} ranks on this node")
    return local_rank


def physical_gpu(local_rank: int, env: Optional[Mapping[str, str]] = None) -> str:
    """The physical device id (as in CUDA_VISIBLE_DEVICES / nvidia-smi) of ``local_rank``'s GPU."""
    vis = visible_devices(env)
    ordinal = gpu_for_local_rank(local_rank, env=env)
    if vis is None:
        return str(ordinal)
    return vis[ordinal]


def main(argv=None) -> int:
    """``python -m launch.discovery``: print this rank's layout (a launcher check)."""
    try:
        info = require_single_node()
    except MultiNodeError as e:
        print(f"kog: {e}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps({"rank": info.rank, "size": info.size, "local_rank": info.local_rank,
                      "local_size": info.local_size, "hostname": info.hostname,
                      "source": info.source}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
