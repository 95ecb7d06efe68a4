"""`kog-worker` (also `python -m workers`, `kog serve`): the rank program.

    mpiexec -n N kog-worker --model PATH --control tcp://127.0.0.1:5555

Each rank learns who it is from MPI, places itself (topology), loads only its lanes, joins the KCCL
group and builds its backend. Rank 0 then serves the control plane; the others follow its commands.
With --oneshot REQUEST_JSON the job runs one request, rank 0 prints it, and every rank exits.
"""
from __future__ import annotations

import argparse
import os
import sys

from .keeper import keep

# Ranks share the cores: one BLAS thread each, unless the user said otherwise (read when workers.job
# loads numpy). A job of one rank keeps the machine's threads (the cpu backend picks 1 or all per
# step, workers/cpu_decode.ThreadChooser).
_SIZE = next((os.environ[v] for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS") if v in os.environ), "1")
if _SIZE != "1":
    for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_v, "1")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kog-worker", description="One rank of a kog_dist job (start N under mpiexec).")
    p.add_argument("--model", help="a Laneformer or Hugging Face directory, a .gguf file, or a built-in name "
                   "(default: smollm2-135m-instruct, fetched once; tiny-random: a small random model)")
    p.add_argument("--control", default="tcp://127.0.0.1:5555", help="ZMQ endpoint rank 0 binds")
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--max-seq", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--dtype", default=None, help="storage of the layer matrices: bf16, fp16, fp32, q8_0, q4_0, "
                   "q4_1 (default: the model's own)")
    p.add_argument("--bind", choices=("none", "cores", "numa"), default="cores",
                   help="CPU/memory binding from the placement plan (default: cores)")
    p.add_argument("--slots", type=int, default=4, help="KV caches kept for sessions")
    p.add_argument("--queue-limit", type=int, default=8, help="requests waiting behind the active one")
    p.add_argument("--speculative", type=int, default=None, metavar="K",
                   help="prompt-lookup speculative decoding with up to K draft tokens (0..8; 0 = off) for requests "
                        "that do not say (default: the backend's, kog_dist.speculative.DEFAULT_DRAFT)")
    p.add_argument("--session-ttl", type=float, default=600.0, help="idle seconds before a session expires")
    p.add_argument("--session-ttl-max", type=float, default=600.0,
                   help="the longest ttl_s a client may ask for (default 600 s)")
    p.add_argument("--client-sessions", type=int, default=8, help="sessions one client may hold (default 8)")
    p.add_argument("--client-queue", type=int, default=None,
                   help="queue places one client may hold (default half of --queue-limit)")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --control (needs CURVE keys)")
    p.add_argument("--curve-server-key", help="server secret key file (zmq.auth format)")
    p.add_argument("--curve-clients", help="directory of authorised client public keys")
    p.add_argument("--oneshot", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if not a.oneshot:   # a server's rank runs as a child of a keeper under MPICH's hydra, so that a rank
        # dying of a signal reaches its clients (workers/keeper.py says why); a one-shot job has no
        # clients, and there the keeper's extra hop lets hydra SIGKILL the ranks still leaving after
        # an error (a "BAD TERMINATION" banner instead of the one-line error and exit 2)
        keep()
    # imported here, not at the top: the keeper forks the rank before anything else loads (keeper.py)
    from .job import SaidOnRank0, leave, run
    try:
        rc = run(a)
    except KeyboardInterrupt:
        leave(130)
    except SaidOnRank0 as e:   # rank 0 prints the job's error; the others leave with its exit status
        leave(e.rc)
    except Exception as e:  # one line, never a traceback (KOG_DEBUG=1 shows it)
        if os.environ.get("KOG_DEBUG"):
            raise
        rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "?"
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"kog-worker: error: rank {rank}: {msg}", file=sys.stderr, flush=True)
        # leave here, while the exception still holds the failed run's frames: releasing them would
        # destroy its CuPy streams and events, and after a sticky CUDA error (a peer's death under
        # MPS) each destructor prints an "Exception ignored" traceback
        leave(2 if isinstance(e, ValueError) else 1)
    if rc != 0:
        leave(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
