"""Bootstrap of the shm transport: name the segments, create, map every peer's, unlink.

Ranks meet through a rendezvous (rendezvous.py: MPI normally; one string, ok votes, barriers). Steps:

1. rank 0 picks a base name "<prefix>-<pid>-<random>" and broadcasts it;
2. every rank creates "<base>-r<rank>" (O_EXCL, fallocated), writes its header (pid, start time,
   layout hash) and marks it READY; all ranks agree that every create succeeded;
3. every rank maps every peer's segment and checks its header; all ranks agree again;
4. every rank unlinks its own name (unless `unlink_after_attach=False`); the mappings stay.

A failure on any rank makes every rank unlink what it created and raise KcclError, with no hang.
"""

from __future__ import annotations

import os
import secrets

from . import layout as L
from .errors import KcclError
from .shm import SHM_DIR, Segment, process_starttime, segment_prefix, unlink_quietly


def check_one_host(rdv) -> int:
    """Raise unless every rank shares this host's memory; return the number of local ranks."""
    nlocal = rdv.local_ranks()
    if not rdv.agree(nlocal == rdv.size):
        raise KcclError("the shm transport needs every rank on one host (shared memory); "
                        f"this rank sees {nlocal} of {rdv.size} ranks locally")
    return nlocal


def write_header(seg: Segment, lay: L.SegmentLayout, rank: int) -> None:
    w = seg.words
    w[L.H_VERSION] = L.VERSION
    w[L.H_NRANKS] = lay.nranks
    w[L.H_RANK] = rank
    w[L.H_PID] = os.getpid()
    w[L.H_STARTTIME] = process_starttime(os.getpid())
    w[L.H_LAYOUT_HASH] = lay.layout_hash
    w[L.H_SIZE] = lay.size
    w[L.H_MAGIC] = L.MAGIC
    w[L.H_STATE] = L.STATE_READY


def check_header(seg: Segment, lay: L.SegmentLayout, rank: int) -> None:
    w = seg.words
    problems = []
    if w[L.H_MAGIC] != L.MAGIC or w[L.H_STATE] != L.STATE_READY:
        problems.append("not a ready kccl segment")
    if w[L.H_RANK] != rank:
        problems.append(f"rank {w[L.H_RANK]} != {rank}")
    if w[L.H_LAYOUT_HASH] != lay.layout_hash:
        problems.append("layout differs (max_floats, depth, tags and nranks must match on every rank)")
    if problems:
        raise KcclError(f"{seg.path}: " + "; ".join(problems))


def open_segments(rdv, lay: L.SegmentLayout, prefix: str | None = None,
                  unlink_after_attach: bool = True) -> list[Segment]:
    """Create this rank's segment and map every peer's; returns segments indexed by rank."""
    rank, size = rdv.rank, rdv.size
    base = None
    if rank == 0:
        base = f"{prefix or segment_prefix()}-{os.getpid()}-{secrets.token_hex(4)}"
    base = rdv.share_str(base)
    paths = [os.path.join(SHM_DIR, f"{base}-r{r}") for r in range(size)]

    own, error = None, None
    try:
        own = Segment.create(paths[rank], lay.size)
        write_header(own, lay, rank)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = exc
    if not rdv.agree(error is None):
        if own is not None:
            own.unlink()
            own.close()
        raise KcclError(f"rank {rank}: creating shared-memory segments failed"
                        + (f": {error}" if error else " on another rank")) from error

    segs: list[Segment | None] = [None] * size
    segs[rank] = own
    try:
        for r in range(size):
            if r != rank:
                segs[r] = Segment.open(paths[r], lay.size)
                check_header(segs[r], lay, r)
    except Exception as exc:  # noqa: BLE001
        error = exc
    if not rdv.agree(error is None):
        for seg in segs:
            if seg is not None:
                seg.close()
        own.unlink()
        for r in range(size):
            if r != rank:
                unlink_quietly(paths[r])
        raise KcclError(f"rank {rank}: mapping peer segments failed"
                        + (f": {error}" if error else " on another rank")) from error
    if unlink_after_attach:
        rdv.barrier()  # every rank has mapped every segment: the names are no longer needed
        own.unlink()
    return segs


def create_local_segments(lay: L.SegmentLayout, prefix: str | None = None) -> list[list[Segment]]:
    """All ranks' segments in this process: result[r] is rank r's own list of mappings (by rank)."""
    base = f"{prefix or segment_prefix()}-{os.getpid()}-{secrets.token_hex(4)}"
    paths = [os.path.join(SHM_DIR, f"{base}-r{r}") for r in range(lay.nranks)]
    owners = []
    try:
        for r, path in enumerate(paths):
            owners.append(Segment.create(path, lay.size))
            write_header(owners[-1], lay, r)
        views = []
        for r in range(lay.nranks):
            views.append([owners[r] if q == r else Segment.open(paths[q], lay.size)
                          for q in range(lay.nranks)])
    finally:
        for path in paths:
            unlink_quietly(path)
    for seg in owners:
        seg.linked = False
    return views
