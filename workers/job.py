"""One rank's job, once kog-worker (workers/__main__.py) has parsed its arguments and, under hydra,
forked the rank from its keeper: MPI bootstrap, placement, the model's lanes, the KCCL group, the
backend; then rank 0 serves the control plane (or runs the one-shot request) and the others follow.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import kccl
from kccl import optional
from kccl.mpi_plain import allgather_bytes, allreduce_int, bcast_str, forbid_pickle
from kccl.shm import unlink_mpich_segments
from kog_dist.control_auth import CurveKeys, check_endpoint
from kog_dist.coordinator import Coordinator
from kog_dist.formats import open_model
from kog_dist.models import model_id, resolve_model
from kog_dist.speculative import default_draft
from kog_dist.tokenizer import load_tokenizer
from kog_dist.tp_lanes import LaneSource
from launch.discovery import require_single_node
from topology.place import place_rank
from topology.probe import mps_running

from .cuda.multirank import comm_kwargs
from .factory import choose, cuda_available, make_backend
from .heartbeat import Heartbeat
from .oneshot import build_request, check_rank_count, emit, result_json
from .rank import KcclExchange, RankGroup, follow, make_agree


def log(msg: str) -> None:
    print(f"[kog-worker] {msg}", file=sys.stderr, flush=True)


def leave(rc: int) -> None:
    """MPI_Finalize at interpreter exit waits for every rank; after a failure some may be gone, so
    leave without it (and without the interpreter's teardown) rather than hang."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def run(a) -> int:
    MPI = optional.mpi()   # MpiMissing says in one line what to install

    forbid_pickle()
    world = MPI.COMM_WORLD
    info = require_single_node(world)
    rank, size = info.rank, info.size
    _unlink_mpi_segments(world, info.local_rank)
    model = _from_rank0(world, lambda: resolve_model(a.model))   # a built-in model is fetched once, by rank 0
    # rank 0 opens (and so validates) the model first: a bad file is said once, by rank 0
    src = _rank0_first(world, lambda: open_model(model, progress=None if rank == 0 else False))
    cfg = src.cfg
    _all_or_none(world, lambda: check_rank_count(cfg, size))   # refuses N the model cannot split into, once
    tp = cfg.num_lanes == 1 and size > 1      # a one-lane model over several ranks: tensor parallelism
    lanes = range(0, 1) if tp else cfg.lanes_of_rank(rank, size)
    if not a.oneshot:   # and so does an endpoint rank 0 may not bind: on every rank (same arguments, same
        # node), so that every rank leaves with the error and none is left waiting in the next collective
        keys = CurveKeys(a.curve_server_key, a.curve_clients) if a.curve_server_key else None
        check_endpoint(a.control, a.allow_remote, keys)
    here = a.backend != "cpu" and cuda_available()
    # every rank takes the same decision (bootstrap only: one allreduce of a flag)
    everywhere = bool(allreduce_int(world, int(here), MPI.MIN)) if size > 1 else here
    kind, note = _all_or_none(world, lambda: choose(a.backend, size, here, everywhere, cfg))   # said once
    if kind == "cuda" and tp:      # the cuda backend splits a one-lane model as N all-early lanes (tp_lanes)
        src, tp = LaneSource(src, size), False
        cfg, lanes = src.cfg, src.cfg.lanes_of_rank(rank, size)
    if a.speculative is None:      # not given: the backend's default (kog_dist.speculative.DEFAULT_DRAFT)
        a.speculative = default_draft(kind)
    if note and rank == 0:
        log(note)
    placed = _place(a, info, use_gpus=kind == "cuda")   # before the buffers below, so they are near the rank
    max_floats = max(cfg.hidden_size, 1 << 16)
    comm = kccl.Communicator.create(world, transport="shm", max_floats=max_floats,
                                    depth=cfg.broadcast_delay + 2, tags=("attn", "mlp"))
    gcomm = None   # --backend cuda, several ranks: the monokernels exchange through kccl cuda_ipc
    if kind == "cuda" and size > 1:
        cp = optional.cupy()
        cp.cuda.Device(info.local_rank % cp.cuda.runtime.getDeviceCount()).use()   # before create (one GPU: MPS)
        gcomm = kccl.Communicator.create(world, transport="cuda_ipc", **comm_kwargs(cfg, size))
        if rank == 0 and len(set(gcomm.bus_ids)) < size and not mps_running():
            log(f"{size} ranks share {len(set(gcomm.bus_ids))} GPU(s) and the MPS daemon does not seem to run: "
                "their persistent kernels time-slice and every exchange waits for a slice (slow); start "
                "`nvidia-cuda-mps-control -d` first")
    if rank != 0 and not a.oneshot:
        # SIGTERM reaches every rank (mpiexec, scancel); rank 0 winds the job down and tells the
        # followers to exit, so they must outlive it rather than die mid-exchange.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    if not a.oneshot:
        # SIGUSR1 is hydra's notice (-disable-auto-cleanup, kog launch --keep-survivors) that a rank
        # ended, sent after a clean shutdown too, to whichever ranks are still leaving: only rank 0's
        # coordinator acts on it (while it serves); a follower learns of rank 0's end from kccl.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    hb = None
    try:
        backend, cfg = _all_or_none(world, lambda: make_backend(
            kind, src, lanes=lanes, max_seq=a.max_seq, exchange=KcclExchange(comm) if size > 1 else None,
            agree=make_agree(comm), num_slots=max(1, a.slots), progress=None if rank == 0 else False,
            comm=gcomm or comm, prefill_chunk=max_floats // cfg.hidden_size, dtype=a.dtype,
            speculative=a.speculative > 0, tp=(rank, size) if tp else None))
        if not a.oneshot:   # every rank, once all are built (loading and compiling may hold a rank up)
            hb = Heartbeat.start(world, log=log)
        if rank != 0 and not a.oneshot:
            return follow(backend, comm, log, lambda: load_tokenizer(src))
        if a.oneshot:
            return _oneshot(a, src, cfg, backend, comm, kind)
        split = (f"tensor parallel ({_tp_line(backend)})" if tp else
                 f"tensor parallel as {size} lanes (heads and FFN columns of lane 0 on rank 0)"
                 if isinstance(src, LaneSource) else f"lanes {lanes.start}..{lanes.stop - 1} on rank 0")
        log(f"{size} rank(s), backend {kind}, {split}, binding {placed}")
        return _serve(a, src, cfg, backend, comm, hb)
    finally:
        if hb is not None:
            hb.close()
        if gcomm is not None:   # clean exit: collective shutdown (a peer's last ack may still land)
            gcomm.shutdown() if sys.exc_info()[0] is None else gcomm.close()
        comm.close()


def _tp_line(backend) -> str:
    p = backend.tp.plan
    return (f"heads {p.heads.start}..{p.heads.stop - 1}, KV heads {p.kv.start}..{p.kv.stop - 1}"
            f"{' replicated' if p.kv_replicated else ''}, FFN {p.ffn.start}..{p.ffn.stop - 1}, "
            f"vocab {p.vocab.start}..{p.vocab.stop - 1} on rank 0")


class SaidOnRank0(Exception):
    """This rank's job failed and rank 0 says why: leave with `rc`, printing nothing."""

    def __init__(self, rc: int):
        super().__init__("")
        self.rc = rc


def _one_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _rc_of(e: BaseException) -> int:
    return 2 if isinstance(e, ValueError) else 1


def _from_rank0(world, make) -> str:
    """Rank 0's `make()` (a string) on every rank; if it fails there, rank 0 says so once and every
    rank leaves, so none is left waiting for rank 0 in a later collective."""
    return _rank0_first(world, make, value=True)


def _rank0_first(world, make, value: bool = False):
    """`make()` on rank 0, then (if it worked) on the others; `value`: the others take rank 0's
    string instead of calling make. A failure on rank 0 is said there (once) and every rank leaves."""
    if world.Get_size() == 1:
        return make()
    text, got = "", None
    if world.Get_rank() == 0:
        try:
            got = make()
            text = "ok " + (got if value else "")
        except Exception as e:  # noqa: BLE001 (said below, after telling the others)
            failure = e
            text = f"error {_rc_of(e)}"
    text = bcast_str(world, text)
    if text.startswith("error "):
        mine = failure if world.Get_rank() == 0 else None
        _say_once(world, mine and _one_line(mine), 0, int(text.split()[1]), mine)
    if world.Get_rank() == 0:
        return got
    return text[3:] if value else make()


def _all_or_none(world, make):
    """`make()` on every rank; if it fails on any, rank 0 says the first failure (with its rank) and
    every rank leaves: a bad weight read by every rank is said once, one read by one rank is said too."""
    if world.Get_size() == 1:
        return make()
    try:
        got, mine = make(), b""
    except Exception as e:  # noqa: BLE001 (reported below, once)
        got, mine = None, f"{_rc_of(e)} {_one_line(e)}".encode()
    errs = allgather_bytes(world, mine)
    bad = [(r, m.decode(errors="replace")) for r, m in enumerate(errs) if m]
    if not bad:
        return got
    r, m = bad[0]
    rc, msg = m.split(" ", 1)
    _say_once(world, msg, r, int(rc))


def _say_once(world, msg, rank: int, rc: int, exc=None):
    """Rank 0 prints `msg` as rank `rank`'s error; every rank waits for that, then leaves with `rc` (a
    rank leaving first could have the launcher kill rank 0 before it says anything). KOG_DEBUG=1:
    rank 0 raises its own `exc` instead."""
    if world.Get_rank() == 0:
        if exc is not None and os.environ.get("KOG_DEBUG"):
            raise exc
        print(f"kog-worker: error: rank {rank}: {msg}", file=sys.stderr, flush=True)
    world.Barrier()
    raise SaidOnRank0(rc)


def _unlink_mpi_segments(world, local_rank: int) -> None:
    """MPICH's node segment outlives a SIGKILLed rank: once every rank has it mapped (the barrier), drop its
    name (kccl.shm.unlink_mpich_segments), so nothing is left in /dev/shm whatever way the job ends, also
    when a rank dies while the model loads, before kccl's Communicator.create drops it too."""
    world.Barrier()
    if local_rank == 0:
        unlink_mpich_segments()
    world.Barrier()


def _place(a, info, use_gpus: bool) -> str:
    """Bind this rank as the node's plan says: one GPU a rank for the cuda backend; cores only for the cpu
    backend, also on a GPU machine (there a GPU plan of more ranks than GPUs fails, and nothing was bound)."""
    if a.bind == "none":
        return "none"
    done = place_rank(info.rank, info.size, info.local_rank, a.bind, local_size=info.local_size,
                      use_gpus=use_gpus)
    if done.get("error"):
        return f"skipped ({done['error']})"
    return f"{a.bind}: cores {done.get('cores')}, numa {done.get('numa')}, gpu {done.get('gpu')}"


def _serve(a, src, cfg, backend, comm, hb=None) -> int:
    group = RankGroup(backend, comm, heartbeat=hb)
    keys = (a.curve_server_key, a.curve_clients) if a.curve_server_key else None
    if not 0 <= a.speculative <= 8:
        raise ValueError(f"--speculative must be 0..8 draft tokens, got {a.speculative}")
    if a.speculative > 0 and hasattr(backend, "prepare_speculative"):
        backend.prepare_speculative()   # the cuda backend's speculative build before the first request
    try:
        coord = Coordinator(a.control, group, load_tokenizer(src), cfg, allow_remote=a.allow_remote,
                            curve_keys=keys, queue_limit=a.queue_limit, session_ttl_s=a.session_ttl,
                            speculative=a.speculative,
                            session_ttl_max_s=a.session_ttl_max, max_client_sessions=a.client_sessions,
                            queue_share=a.client_queue)
        # `health` tells gateways what they serve: the file's or folder's name, not GGUF's general.name
        coord.model_name = model_id(src.path) if getattr(src, "path", None) else getattr(src, "name", None)
        rc = coord.serve()
        if hb is not None and hb.lost:
            # a frozen rank: the clients were told; the decode thread may still wait in kccl on it, so
            # neither tell the followers nor close the communicator under it: end the frozen rank
            # (nothing else would) and leave (the followers see rank 0 gone and follow)
            hb.kill_lost()
            leave(1)
        return rc
    finally:
        group.close()


def _oneshot(a, src, cfg, backend, comm, kind) -> int:
    req = argparse.Namespace(**json.loads(a.oneshot))
    req.max_seq = req.max_seq or a.max_seq
    if comm.rank != 0:
        return follow(backend, comm, log, lambda: load_tokenizer(src))
    tok = load_tokenizer(src)
    group = RankGroup(backend, comm)
    try:
        ids, cmd = build_request(req, cfg, tok, kind)
        res = group.run(cmd)
    finally:
        group.close()
    out = result_json(ids, res, tok, kind, comm.size, src.path)
    emit(out, req.json)
    return 0
