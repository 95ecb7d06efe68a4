"""kccl `cuda_ipc` bench: `python -m kccl.bench --transport cuda_ipc` (kccl/bench.py calls bench_main).

Under MPI, one rank per GPU or N ranks on one GPU under MPS: p50/p99 of the host calls (allreduce,
post, collect delta posts later, barrier), of all-reduces and post/collect pairs inside the persistent
test kernel (CudaCommunicator.run_rounds; the "kernel LL" rows: LL words, run_rounds(ll=True), on a tag
of their own), and of NCCL's all-reduce beside it where NCCL can run.
"""

from __future__ import annotations

import json
import time

import numpy as np

from . import optional
from .cuda_ipc import CudaCommunicator
from .mpi_plain import allgather_json, bcast_str


def _pct(samples_ns) -> dict:
    a = np.asarray(samples_ns, dtype=np.float64)
    p50, p99 = np.percentile(a, [50, 99]) / 1e3
    return {"p50_us": round(float(p50), 2), "p99_us": round(float(p99), 2)}


def _share_nccl_id(world, uid):
    """Rank 0's NCCL unique id on every rank, in the type CuPy gave it (bytes in CuPy 14, a tuple of
    ints before), without pickle."""
    msg = None
    if world.rank == 0:
        msg = json.dumps({"hex": bytes(uid).hex()} if isinstance(uid, (bytes, bytearray)) else {"ints": list(uid)})
    d = json.loads(bcast_str(world, msg))
    return bytes.fromhex(d["hex"]) if "hex" in d else tuple(d["ints"])


def bench_main(args) -> int:
    """`python -m kccl.bench --transport cuda_ipc`: run under MPI (one rank per GPU, or N ranks on one
    GPU under MPS). Rank r uses device r % device_count."""
    cp, MPI = optional.cupy(), optional.mpi()
    world = MPI.COMM_WORLD
    ndev = cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(world.rank % ndev).use()
    n = args.floats
    iters, warm, delta = args.iters, args.warmup, args.delta
    rows, notes = {}, []
    clock = time.perf_counter_ns
    # max_floats=n: a slot holds 4n bytes, the n fp16 as n / 2 LL words exactly; depth >= 2 for LL
    with CudaCommunicator.create(world, max_floats=n, depth=max(delta + 1, 2), tags=("bench", "ll"),
                                 timeout=60.0) as comm:
        rng = np.random.default_rng(comm.rank)
        x = cp.asarray(rng.standard_normal(n).astype(np.float16))
        out = cp.empty_like(x)
        samples = {k: [] for k in ("host allreduce", "host post", f"host collect (delta={delta})",
                                   "host barrier")}
        comm.barrier()
        for i in range(warm + iters):
            t0 = clock()
            comm.allreduce(x, out=out)
            if i >= warm:
                samples["host allreduce"].append(clock() - t0)
        comm.barrier()
        handles = []
        for i in range(warm + iters + delta):
            t0 = clock()
            if i < warm + iters:
                handles.append(comm.post("bench", x))
            t1 = clock()
            if len(handles) > delta or i >= warm + iters:
                comm.collect(handles.pop(0), out=out)
            t2 = clock()
            if warm <= i < warm + iters:
                samples["host post"].append(t1 - t0)
            if warm + delta <= i:
                samples[f"host collect (delta={delta})"].append(t2 - t1)
        comm.barrier()
        for i in range(warm + iters):
            t0 = clock()
            comm.barrier()
            if i >= warm:
                samples["host barrier"].append(clock() - t0)
        # inside one persistent kernel
        inputs = cp.asarray(rng.standard_normal((8, n)).astype(np.float16))
        spans = {}
        runs = [("kernel allreduce", 0, 1), ("kernel allreduce 4 blocks", 0, 4)]
        if n % 2 == 0:
            runs += [("kernel LL allreduce", 0, 1), ("kernel LL allreduce 4 blocks", 0, 4)]
        else:
            notes.append(f"kernel LL rows: not run: {n} fp16 is odd (LL words hold two)")
        if delta > 0:
            runs.append((f"kernel post/collect (delta={delta})", delta, 1))
        for label, dl, nb in runs:
            comm.barrier()
            ll = " LL " in label
            _, times = comm.run_rounds("ll" if ll else "bench", inputs, warm + iters, delta=dl, nblocks=nb,
                                       ll=ll)
            t = times[warm:].astype(np.int64)
            post, coll = t[:, 1] - t[:, 0], t[:, 2]
            if dl == 0:
                samples[label] = list(post + coll)
            else:
                samples[label + " post"] = list(post)
                samples[label + " collect"] = list(coll)
                samples[label + " pair"] = list(post + coll)
            spans[label] = float(t[-1, 0] - t[0, 0]) / max(1, len(t) - 1)
        # NCCL beside it
        nccl_note = None
        distinct = len(set(comm.bus_ids)) == comm.size
        if comm.size > 1 and not distinct:
            nccl_note = (f"NCCL: not run: the {comm.size} ranks share one GPU ({comm.bus_ids[0]}); NCCL "
                         "refuses two ranks on one device, so there is no NCCL number for this setup")
        else:
            try:
                nccl = optional.nccl()
                uid = _share_nccl_id(world, nccl.get_unique_id() if comm.rank == 0 else None)
                nc = nccl.NcclCommunicator(comm.size, uid, comm.rank)
                s = cp.cuda.Stream(non_blocking=True)
                lat = []
                for i in range(warm + iters):
                    t0 = clock()
                    nc.allReduce(x.data.ptr, out.data.ptr, n, nccl.NCCL_FLOAT16, nccl.NCCL_SUM, s.ptr)
                    s.synchronize()
                    if i >= warm:
                        lat.append(clock() - t0)
                samples["NCCL allreduce (host)"] = lat
            except Exception as exc:  # noqa: BLE001
                nccl_note = f"NCCL: not run: {type(exc).__name__}: {exc}"
        comm.barrier()
    rows = {}
    for k, v in samples.items():
        allv = allgather_json(world, [int(x) for x in v])  # host ints, after the timed loops
        if world.rank == 0:
            rows[k] = _pct(np.concatenate([np.asarray(a, dtype=np.int64) for a in allv]))
    spans_all = allgather_json(world, spans)
    if world.rank != 0:
        return 0
    mean_span = {k: round(float(np.mean([s[k] for s in spans_all])) / 1e3, 2) for k in spans}
    report = {"transport": "cuda_ipc", "nranks": world.size, "elements": n, "dtype": "float16",
              "iters": iters, "delta": delta, "devices": sorted(set(comm.bus_ids)),
              "results": rows, "kernel_mean_loop_us": mean_span, "nccl": nccl_note or "ran", "notes": notes}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"kccl cuda_ipc: {world.size} ranks on {len(set(comm.bus_ids))} GPU(s) {report['devices']}, "
              f"{n} fp16 ({n * 2 / 1024:g} KiB), {iters} iters, delta={delta}")
        print(f"{'op':<44}{'p50 us':>10}{'p99 us':>10}")
        for k, v in rows.items():
            print(f"{k:<44}{v['p50_us']:>10.2f}{v['p99_us']:>10.2f}")
        for k, v in mean_span.items():
            print(f"mean loop period of {k}: {v:.2f} us (globaltimer over all rounds)")
        for line in notes + ([nccl_note] if nccl_note else []):
            print(line)
    return 0

