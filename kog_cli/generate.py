"""`kog generate`: one request, in this process or through N ranks under mpiexec."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

from kccl.shm import sweep_mpich_segments
from kog_dist.formats import open_model
from kog_dist.tokenizer import load_tokenizer
from launch.cli import LaunchError, build_command, detect
from workers.factory import choose, make_backend, resolve
from workers.oneshot import build_request, check_rank_count, result_json


def generate_one_process(a) -> dict:
    src = open_model(a.model)
    tok = load_tokenizer(src)
    kind = resolve(a.backend)
    ids, cmd = build_request(a, src.cfg, tok, kind)     # refuse bad input before any weight is read
    backend, cfg = make_backend(kind, src, max_seq=a.max_seq, num_slots=1, dtype=a.dtype)
    stream = not a.json and sys.stdout.isatty()
    try:
        res = backend.run(cmd, _streamer(tok, cmd.stop_ids + cfg.eos_token_ids) if stream else None)
    finally:
        backend.close()
    out = result_json(ids, res, tok, kind, 1, a.model)
    out["streamed"] = stream
    return out


def _streamer(tok, terminal):
    text = tok.stream()     # incremental: never splits a multi-byte character

    def on_token(t):
        if t not in terminal:
            sys.stdout.write(text.step(t))
            sys.stdout.flush()
        return True
    return on_token


def run_under_mpiexec(a) -> int:
    """`kog generate --np N`: the same request through N ranks; rank 0 prints the result."""
    src = open_model(a.model)
    cfg = src.cfg
    tok = load_tokenizer(src)
    if a.backend == "cuda" and a.nranks > 1:
        choose("cuda", a.nranks, True, True, cfg)     # the multi-rank kernel's rules, refused in one line
    if getattr(a, "json_schema", None):
        a.json_schema = os.path.abspath(a.json_schema)   # read again by rank 0 of the job
    build_request(a, cfg, tok, resolve(a.backend))   # bad input fails here, before any rank starts
    check_rank_count(cfg, a.nranks)               # and so does a rank count the model cannot split into
    src.close()
    req = {k: getattr(a, k) for k in ("prompt", "prompt_ids", "max_new_tokens", "temperature", "top_k",
                                      "top_p", "seed", "stop_ids", "max_seq", "json", "raw", "system", "speculative",
                                      "json_schema")}
    try:   # MPICH's mpiexec, Open MPI's mpirun (with its root and oversubscribe flags), or srun
        cmd = build_command(detect(), a.nranks, [
            sys.executable, "-m", "workers", "--model", a.model, "--backend", a.backend,
            "--bind", "none", *(["--dtype", a.dtype] if a.dtype else []), "--oneshot", json.dumps(req)])
    except LaunchError as e:
        raise ValueError(f"--np needs an MPI launcher: {e}") from None
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_kill_group(proc), sys.exit(143)))
    try:
        rc = proc.wait()
        if rc not in (0, 2):       # 2: the ranks said why in one line (bad input, a damaged file)
            how = f"killed by {signal.Signals(rc).name}" if 0 < rc < 32 and rc not in (1, 2) else f"exit {rc}"
            print(f"kog: error: the {a.nranks}-rank job failed ({how}): a rank died or was killed, "
                  f"and mpiexec ended the others", file=sys.stderr)
        return rc
    except KeyboardInterrupt:
        return 130
    finally:
        _kill_group(proc)
        sweep_mpich_segments(started, job_session=proc.pid)   # a rank killed while starting left one
        signal.signal(signal.SIGTERM, previous)


def _die_with_parent() -> None:
    """In the child before exec: mpiexec gets SIGTERM if `kog generate` itself is killed."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the explicit kill paths still apply
        pass


def _kill_group(proc) -> None:
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            t = time.time() + wait
            while proc.poll() is None and time.time() < t:
                time.sleep(0.05)
