"""Latency of kccl ops: `python -m kccl.bench --transport shm -n N [--json]`.

Re-launches itself under `mpiexec -n N` unless already under an MPI launcher. Every rank times each
call with perf_counter_ns; rank 0 gathers all samples (MPI, after the timed loops) and prints p50/p99
in microseconds for:

    allreduce       one hidden-size float32 vector (--floats, default 3072)
    post            DTP post of that vector
    collect(δ)      its collect, δ posts later (--delta); the time a layer would stall
    post+collect    the two per layer together
    barrier

`--compute-us U` busy-waits U µs between layers (stand-in for a layer's math). `--transport cuda_ipc`
runs kccl.cuda_bench.bench_main (fp16 device vectors: host calls, a persistent kernel, NCCL beside it;
docs/kccl-gpu.md); it exits 2 where CuPy or a GPU is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from . import optional
from .communicator import Communicator
from .cuda_bench import bench_main
from .cuda_ipc import cupy_missing
from .mpi_plain import forbid_pickle
from .mpirun import find_mpiexec, launcher_env, under_mpi
from .optional import mpi_missing


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m kccl.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--transport", default="shm", choices=["shm", "cuda_ipc"])
    ap.add_argument("-n", "--nranks", type=int, default=2, help="ranks to launch (ignored under MPI)")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--floats", type=int, default=3072, help="float32 per vector (hidden size)")
    ap.add_argument("--delta", type=int, default=2, help="DTP delay: collect this many posts later")
    ap.add_argument("--compute-us", type=float, default=0.0, help="busy work between layers")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before the launch is killed")
    return ap.parse_args(argv)


def relaunch(args, argv) -> int:
    try:
        mpiexec = find_mpiexec()
    except FileNotFoundError as exc:
        print(f"kccl.bench: error: {exc}", file=sys.stderr)
        return 2
    cmd = [mpiexec, "-n", str(args.nranks), sys.executable, "-m", "kccl.bench"] + list(argv)
    env = launcher_env(dict(os.environ, PYTHONUNBUFFERED="1"))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait(timeout=args.timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        proc.send_signal(2)  # hydra forwards it and kills the ranks
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
        print("kccl.bench: launch stopped (timeout or interrupt)", file=sys.stderr)
        return 1


def busy(us: float) -> None:
    if us > 0:
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass


def measure(comm, args) -> dict:
    """Per-op arrays of latencies in ns (this rank's timed iterations)."""
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(args.floats).astype(np.float32)
    out = np.empty_like(x)
    total = args.warmup + args.iters
    clock = time.perf_counter_ns
    samples = {k: np.zeros(total, np.int64) for k in ("allreduce", "post", "collect", "pair", "barrier")}

    comm.barrier()
    for i in range(total):
        t0 = clock()
        comm.allreduce(x, out=out)
        samples["allreduce"][i] = clock() - t0

    comm.barrier()
    handles = []
    for i in range(total + args.delta):
        t0 = clock()
        if i < total:
            handles.append(comm.post("bench", x))
        t1 = clock()
        if len(handles) > args.delta or i >= total:
            comm.collect(handles.pop(0), out=out)
        t2 = clock()
        j = i - args.delta
        if i < total:
            samples["post"][i] = t1 - t0
        if 0 <= j < total:
            samples["collect"][j] = t2 - t1
            samples["pair"][j] = samples["post"][j] + (t2 - t1)
        busy(args.compute_us)

    comm.barrier()
    for i in range(total):
        t0 = clock()
        comm.barrier()
        samples["barrier"][i] = clock() - t0
    return {k: v[args.warmup:] for k, v in samples.items()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.transport == "cuda_ipc":
        why = cupy_missing()
        if why is not None:
            print(f"kccl.bench: error: transport 'cuda_ipc' needs CuPy and a CUDA GPU, and this "
                  f"machine has none ({why}); use --transport shm", file=sys.stderr)
            return 2
    if args.delta < 0 or args.iters < 1:
        print("kccl.bench: --delta must be >= 0 and --iters >= 1", file=sys.stderr)
        return 2
    if not under_mpi():
        why = mpi_missing()
        if why is not None:
            print(f"kccl.bench: error: {why}", file=sys.stderr)
            return 2
        return relaunch(args, argv)
    try:
        MPI = optional.mpi()
    except optional.MpiMissing as exc:
        print(f"kccl.bench: error: {exc}", file=sys.stderr)
        return 2
    forbid_pickle()
    if args.transport == "cuda_ipc":  # device buffers, host calls and a persistent kernel, NCCL beside
        return bench_main(args)

    world = MPI.COMM_WORLD
    with Communicator.create(world, args.transport, max_floats=args.floats,
                             depth=args.delta + 1, tags=("bench",)) as comm:
        samples = measure(comm, args)
    results = {}
    for op, local in samples.items():
        gathered = np.zeros(local.size * world.size, np.int64) if world.rank == 0 else None
        world.Gather(local, gathered, root=0)
        if world.rank == 0:
            p50, p99 = np.percentile(gathered, [50, 99]) / 1e3
            results[op] = {"p50_us": round(float(p50), 2), "p99_us": round(float(p99), 2)}
    if world.rank != 0:
        return 0
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count()
    report = {"transport": args.transport, "nranks": world.size, "floats": args.floats,
              "iters": args.iters, "delta": args.delta, "compute_us": args.compute_us,
              "cores": cores, "results": results}
    if args.json:
        print(json.dumps(report))
    else:
        names = {"allreduce": "allreduce", "post": "post", "collect": f"collect (delta={args.delta})",
                 "pair": "post+collect", "barrier": "barrier"}
        print(f"kccl {args.transport}: {world.size} ranks on {cores} cores, {args.floats} float32 "
              f"({args.floats * 4 / 1024:g} KiB), {args.iters} iters, delta={args.delta}, "
              f"compute={args.compute_us:g} us")
        print(f"{'op':<22}{'p50 us':>10}{'p99 us':>10}")
        for op, name in names.items():
            print(f"{name:<22}{results[op]['p50_us']:>10.1f}{results[op]['p99_us']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
