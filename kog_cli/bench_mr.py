"""`kog bench --np N`: the multi-rank cuda backend (N ranks, each with its lanes' shard and its monokernel,
exchanging partials through kccl's cuda_ipc windows) under the MPI launcher that is present, rank r on GPU
r % (GPUs), several ranks on one GPU only under MPS. Every rank runs the same rows as `kog bench`; rank 0
prints the table. GB/s and "of copy BW" are per GPU: the bytes each GPU streams per token (its ranks'
layer shards and their shares of the LM head's rows) over the copy bandwidth of that GPU, measured alone in the same
run. The PyTorch baselines are one-GPU programs: `kog bench` without --np runs them.
"""
from __future__ import annotations

import os
import sys
import time

IN_MPI = "--in-mpi-rank"     # hidden flag of the ranks' command line


def launch(argv: list[str], nranks: int) -> int:
    """From `kog bench --np N ...`: start N ranks of `python -m kog_cli.bench ... --in-mpi-rank`."""
    import subprocess

    from launch.cli import LaunchError, build_command, detect
    try:
        cmd = build_command(detect(), nranks, [sys.executable, "-m", "kog_cli.bench", *argv, IN_MPI])
    except LaunchError as e:
        print(f"kog bench: error: --np needs an MPI launcher: {e}", file=sys.stderr)
        return 2
    rc = subprocess.call(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if rc != 0:
        print(f"kog bench: error: the {nranks}-rank run failed (exit {rc}); every rank's reason is above",
              file=sys.stderr)
    return rc


def run_rank(args, say, emit) -> int:
    """One rank of `kog bench --np N` (under the launcher)."""
    import cupy as cp
    from mpi4py import MPI

    from kccl import Communicator
    from kccl.mpi_plain import allgather_json, forbid_pickle
    from kog_cli.bench import _commit, finish_rows, measure
    from workers.factory import STORE_NAMES
    from kog_dist.shapes import shape_config
    from workers.cuda.device import cupy_copy_bandwidth, device_name
    from kog_dist.formats import open_model
    from kog_dist.models import resolve_model
    from kog_dist.tp_lanes import LaneSource, rank_config
    from workers.cuda import multirank as mr
    from workers.cuda.backend import CudaBackend
    from workers.cuda.build import build
    from workers.cuda.weights import random_weights, streamed_bytes

    forbid_pickle()
    w = MPI.COMM_WORLD
    rank, n = w.rank, w.size
    if n != args.nranks:
        print(f"kog bench: error: started with {n} ranks, --np says {args.nranks}", file=sys.stderr)
        return 2
    log = say if rank == 0 else (lambda m: None)
    ndev = cp.cuda.runtime.getDeviceCount()
    dev = cp.cuda.Device(rank % ndev)
    dev.use()
    src = None
    if args.shape:
        cfg = rank_config(shape_config(args.shape), n)     # a one-lane shape: as N all-early lanes (tp_lanes)
    else:                                                  # any format; a one-lane model split as lanes
        src = open_model(resolve_model(args.model), progress=False)
        src = LaneSource(src, n) if src.cfg.num_lanes == 1 and n > 1 else src
        cfg = src.cfg
    mr.check(cfg, n)
    comm = Communicator.create(w, transport="cuda_ipc", **mr.comm_kwargs(cfg, n))
    view = mr.RankView(cfg, rank, n)
    on_dev = comm.bus_ids.count(comm.bus_ids[rank])
    gpus = len(set(comm.bus_ids))
    dtype = STORE_NAMES[args.dtype or "bf16"]
    extra = dict(d.split("=", 1) for d in args.define)
    sms = dev.attributes["MultiProcessorCount"]
    nb = args.nblocks or mr.blocks_per_rank(view, sms, on_dev)
    need = max(args.pp + 1, args.prompt + args.gen, args.ctx)
    weights = None
    if args.shape:
        k = build(cfg, dtype, nb, args.prefetch, progress=rank == 0, extra=extra, nranks=n, marks=args.profile)
        args.prefetch = int(k.defines["CFG_PF"])   # the report's args say what ran
        t0 = time.perf_counter()
        weights = random_weights(view, dtype, k, seed=args.seed)
        log(f"random {args.shape} weights of every rank on its device in {time.perf_counter() - t0:.1f} s")
    backend = CudaBackend(src, max_seq=min(need, cfg.max_position_embeddings),
                          num_slots=1, comm=comm, cfg=cfg, weights=weights, nblocks=nb, prefetch=args.prefetch,
                          extra_defines=extra, progress=rank == 0, timing_marks=args.profile,
                          dtype=None if args.shape or args.dtype == "bf16" else dtype)
    # each GPU's copy bandwidth, measured alone (one rank of each GPU, one GPU after the other)
    first_of_gpu = comm.bus_ids.index(comm.bus_ids[rank]) == rank
    bw = 0.0
    for q in range(n):
        if q == rank and first_of_gpu:
            bw = cupy_copy_bandwidth()
        w.Barrier()
    bws = [b for b in allgather_json(w, bw) if b > 0]
    mk = measure(backend, args, log)
    per_gpu = streamed_bytes(backend.rcfg, backend.dw.dtype) * on_dev
    mk["streamed_bytes_per_token"] = per_gpu
    for key in ("tg", "tg_ctx"):
        if key in mk:
            mk[key]["GB_per_s"] = mk[key]["tokens_per_s"] * per_gpu / 1e9
    finish_rows(mk, min(bws))
    same = allgather_json(w, mk["tg"]["ids_head"])
    backend.close()
    comm.shutdown()
    if rank != 0:
        return 0
    name = device_name(dev.id)
    model = f"laneformer-{args.shape} (random)" if args.shape else args.model
    report = {"date": time.strftime("%Y-%m-%d"), "device": f"{gpus} x {name}", "commit": _commit(),
              "sms": sms, "args": vars(args), "ranks": n, "gpus": gpus, "blocks_per_rank": nb,
              "copy_bandwidth_GBps": min(bws) / 1e9, "copy_bandwidth_each_GBps": [b / 1e9 for b in bws],
              "model": f"{model}, {n} ranks", "dtype": backend.dw.dtype, "monokernel": mk,
              "ranks_same_ids": all(x == same[0] for x in same), "baselines": [],
              "note": "GB/s and copy bandwidth per GPU; the PyTorch baselines: kog bench without --np"}
    if not report["ranks_same_ids"]:
        print("kog bench: error: the ranks decoded different ids", file=sys.stderr)
        emit(report, args)
        return 1
    return emit(report, args)
