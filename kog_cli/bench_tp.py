"""`kog bench --np N --backend cpu --model M`: the cpu backend on N ranks under the MPI launcher: a one-lane
(Llama-family) model split by tensor parallelism (heads, FFN columns, vocabulary rows; two kccl shm
all-reduces a layer), a Laneformer by lanes. Every rank runs the same requests; rank 0 prints the table
of `kog bench --backend cpu` (load, pp<N>, tg<G>@<P> on the backend's own BLAS thread setting). GB/s is a
rank's float32 weight bytes per token (its slices and its LM head rows) times tokens/s; the copy
bandwidth is one thread's, measured by rank 0 while the others wait.
"""
from __future__ import annotations

import os
import statistics
import sys
import time


def run_rank(args, say, emit) -> int:
    """One rank of `kog bench --np N --backend cpu` (under the launcher)."""
    import numpy as np
    from mpi4py import MPI

    import kccl
    from kccl.mpi_plain import forbid_pickle
    from kog_dist.backend import RunCommand
    from kog_dist.checkpoint import expected_tensors
    from kog_dist.formats import open_model
    from kog_dist.models import resolve_model
    from kog_dist.tp import tp_bytes_per_token
    from workers.cpu_decode import blas_threads
    from workers.factory import make_backend
    from workers.oneshot import check_rank_count
    from workers.rank import KcclExchange

    from .bench import _commit
    from .bench_cpu import copy_bandwidth, row_sampling

    forbid_pickle()
    w = MPI.COMM_WORLD
    rank, n = w.rank, w.size
    log = say if rank == 0 else (lambda m: None)
    try:
        if rank == 0:
            path = resolve_model(args.model, say=say)       # a built-in model is fetched once
        w.Barrier()
        if rank != 0:
            path = resolve_model(args.model)
        src = open_model(path, progress=False)
        cfg = src.cfg
        check_rank_count(cfg, n)
    except ValueError as e:
        if rank == 0:
            print(f"kog bench: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    tp = cfg.num_lanes == 1 and n > 1
    max_floats = max(cfg.hidden_size, 1 << 16)
    comm = kccl.Communicator.create(w, transport="shm", max_floats=max_floats, depth=cfg.broadcast_delay + 2,
                                    tags=("attn", "mlp"))
    try:
        need = max(args.pp + 1, args.prompt + args.gen)
        t0 = time.perf_counter()
        backend, cfg = make_backend(
            "cpu", src, lanes=None if tp else cfg.lanes_of_rank(rank, n),
            max_seq=min(need, cfg.max_position_embeddings), exchange=KcclExchange(comm), num_slots=1,
            progress=False, comm=comm, prefill_chunk=max_floats // cfg.hidden_size, tp=(rank, n) if tp else None)
        load_s = time.perf_counter() - t0
        log(f"loaded {os.path.basename(path)} on {n} ranks in {load_s:.2f} s "
            f"({'tensor parallel' if tp else 'lanes'})")
        if tp:
            streamed = tp_bytes_per_token(cfg, n, bits=32)
        else:
            full = 4 * sum(int(np.prod(s)) for nm, s in expected_tensors(cfg).items() if "tok_embeddings" not in nm)
            streamed = full // n
        comm.barrier()
        bw = copy_bandwidth() if rank == 0 else 0.0
        comm.barrier()
        rng = np.random.default_rng(args.seed)
        ids = lambda k: [int(x) for x in rng.integers(3, cfg.vocab_size, k)]   # the same on every rank

        sampling = row_sampling(args)

        def go(prompt, gen):
            return backend.run(RunCommand(append=prompt, max_new_tokens=gen, sampling=sampling), ignore_eos=True)

        prompt = ids(args.pp)
        go(prompt, 1)
        ttft = statistics.median(go(prompt, 1).first_token_ms for _ in range(args.reps))
        prompt = ids(args.prompt)
        go(prompt, min(args.gen, 8))
        runs = [go(prompt, args.gen) for _ in range(args.reps)]
        tps = [r.decode_tokens_per_s for r in runs]
        med = statistics.median(tps)
        d = backend.decoder
        mine = "auto" if d.chooser else str(d.threads)
        row = {"threads": mine, "prompt": args.prompt, "gen": len(runs[0].token_ids), "tokens_per_s": med,
               "runs_tokens_per_s": tps, "ms_per_token": 1e3 / med if med else 0.0,
               "GB_per_s": med * streamed / 1e9, "fraction_of_copy_bw": med * streamed / bw if bw else 0.0,
               "ids_head": runs[0].token_ids[:16]}
        backend.close()
    finally:
        comm.close()
    if rank != 0:
        return 0
    say(f"tg{args.gen}: {med:.1f} tokens/s, runs {[round(x, 1) for x in tps]}")
    out = {"pp": {"prompt": args.pp, "ttft_ms": ttft, "tokens_per_s": args.pp / (ttft / 1e3)},
           "load_s": load_s, "streamed_bytes_per_token": streamed, "blas_threads": blas_threads(),
           "tg_threads": [row], "tg": row, "default_threads": mine}
    split = "tensor parallel" if tp else "lanes"
    report = {"date": time.strftime("%Y-%m-%d"), "model": path, "dtype": "F32",
              "device": f"cpu ({os.cpu_count()} cores; numpy backend, {n} ranks, {split}; bytes and GB/s per rank)",
              "copy_bandwidth_GBps": bw / 1e9, "backend_rows": "cpu", "ranks": n, "monokernel": out,
              "baselines": [], "commit": _commit(), "args": vars(args)}
    return emit(report, args)
