"""Run Python under a real `mpiexec -n N` from tests, with a timeout and captured output.

    from mpi_helpers import run_mpi
    res = run_mpi(4, code="from mpi4py import MPI; print(MPI.COMM_WORLD.rank)", timeout=60)
    assert res.returncode == 0, res.output

The launch runs in its own session (process group); on timeout the whole group (mpiexec, its proxy
and every rank) gets SIGKILL and `MpiTimeout` carries what the ranks printed. The repository root is
put on PYTHONPATH, so ranks import the working tree's packages.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from kccl.mpirun import find_mpiexec, flavor, launcher_env, mpiexec_command  # noqa: E402,F401


class MpiTimeout(AssertionError):
    """The launch ran past its timeout; `output` holds what it printed."""

    def __init__(self, message: str, output: str):
        super().__init__(f"{message}\n--- output ---\n{output}")
        self.output = output


@dataclass
class MpiResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return f"[rc={self.returncode}, {self.seconds:.1f} s]\n{self.stdout}\n--- stderr ---\n{self.stderr}"

    def marks(self, word: str) -> list[int]:
        """Sorted ranks that printed "WORD <rank>" (hydra interleaves the ranks' output, so lines
        cannot be trusted; a rank prints e.g. "OK 3" and the test checks marks("OK") == [0..n))."""
        return sorted(int(m) for m in re.findall(rf"{re.escape(word)} (\d+)", self.stdout))


def have_mpiexec() -> bool:
    """True when an mpiexec can be found (tests marked mpi skip otherwise)."""
    try:
        find_mpiexec()
        return True
    except FileNotFoundError:
        return False


def mps_running() -> bool:
    """topology's MPS check; KOG_TEST_MPS=1 says MPS runs where the check cannot see it. An 8-rank kccl
    stress on 2 GPUs without MPS ran past 60 s (every wait on a peer lasts a time slice)."""
    from topology.probe import mps_running as seen
    return os.environ.get("KOG_TEST_MPS") == "1" or seen()


def shared_gpu_reason(n: int) -> str | None:
    """Why n ranks (one process each, spread over this machine's GPUs) cannot run together here, or None."""
    import cupy as cp
    gpus = cp.cuda.runtime.getDeviceCount()
    if n <= gpus or mps_running():
        return None
    return f"{n} ranks on {gpus} GPU(s) share a GPU: start MPS first (nvidia-cuda-mps-control -d)"


_GPU_PROBE = r"""
import cupy as cp
for d in range(cp.cuda.runtime.getDeviceCount()):
    with cp.cuda.Device(d):
        assert int((cp.arange(4) + 1).sum()) == 10
"""


def wait_gpus_ready(timeout: float = 90.0) -> str | None:
    """Wait until a new process can open every GPU and run a kernel there; None once it can, else the
    last failure. After a fault under MPS the server refuses new clients (cudaErrorMpsServerNotReady)
    until the faulted ones have exited and it has recovered, so a test that starts ranks right after
    another test's deliberate fault waits here instead of failing on the previous test's debris."""
    deadline = time.monotonic() + timeout
    why = "not probed"
    while True:
        try:
            p = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True,
                               timeout=max(5.0, deadline - time.monotonic()), env=mpi_env())
            if p.returncode == 0:
                return None
            lines = (p.stderr or p.stdout).strip().splitlines()
            why = lines[-1] if lines else f"exit {p.returncode}"
        except subprocess.TimeoutExpired:
            why = "the probe did not finish"
        if time.monotonic() >= deadline:
            return f"no GPU ready after {timeout:g} s: {why}"
        time.sleep(1.0)


def mpi_env(extra: dict | None = None) -> dict:
    """The environment of every launch the tests make (mpiexec or plain processes): the working tree on
    PYTHONPATH, and as root what Open MPI's mpirun needs to start ranks (kccl.mpirun.launcher_env)."""
    env = launcher_env()
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("PMI_RANK", "PMI_SIZE", "PMI_FD", "HYDI_CONTROL_FD", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        env.pop(name, None)  # a nested launch must not look like a rank of an outer one
    env.update(extra or {})
    return env


def run_mpi(n: int, script: str | None = None, *, code: str | None = None, args=(),
            timeout: float = 60.0, env: dict | None = None, mpiexec_args=(),
            auto_cleanup: bool = True) -> MpiResult:
    """Run `python script args` (or `python -c code args`) on n ranks; never hangs past `timeout`.

    auto_cleanup=False passes the launcher's flags for keeping survivors (kccl.mpirun.keep_survivors_args:
    MPICH's -disable-auto-cleanup, Open MPI's equivalent): when one rank dies, the others are left
    running instead of being killed, so tests can watch how they notice.
    """
    if (script is None) == (code is None):
        raise ValueError("give exactly one of script, code")
    cmd = mpiexec_command(n, keep_survivors=not auto_cleanup)
    cmd += list(mpiexec_args)
    cmd += [sys.executable] + ([script] if script else ["-c", code]) + [str(a) for a in args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(env), cwd=REPO_ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _stop(proc)
        raise MpiTimeout(f"mpiexec -n {n} ran past {timeout} s: {' '.join(cmd[:8])}...",
                         f"{out}\n--- stderr ---\n{err}") from None
    return MpiResult(proc.returncode, out, err, time.monotonic() - start)


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """Stop a launch: SIGINT to mpiexec (hydra then kills every rank, which run in sessions of their
    own, out of reach of killpg; Open MPI's mpirun kills them and removes their /dev/shm segments),
    SIGKILL to its process group if it is still there after 3 s."""
    try:
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=3)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.communicate()


@dataclass
class PlainResult:
    returncodes: list
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return f"[rcs={self.returncodes}, {self.seconds:.1f} s]\n{self.stdout}\n--- stderr ---\n{self.stderr}"


def run_plain(n: int, code: str, *, args=(), timeout: float = 60.0, env: dict | None = None,
              folder: str) -> PlainResult:
    """Run `python -c code args` as n plain processes (no mpiexec): rank r gets env KCCL_RANK=r,
    KCCL_SIZE=n and KCCL_RENDEZVOUS=folder (for kccl.FileRendezvous). Unlike hydra, nothing kills
    the others when one dies, so tests can watch survivors. Every process is killed at `timeout`."""
    start = time.monotonic()
    procs = []
    for r in range(n):
        extra = {"KCCL_RANK": str(r), "KCCL_SIZE": str(n), "KCCL_RENDEZVOUS": folder, **(env or {})}
        procs.append(subprocess.Popen([sys.executable, "-c", code] + [str(a) for a in args],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=mpi_env(extra), cwd=REPO_ROOT))
    outs, errs, rcs, late = [], [], [], False
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, start + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            late = True
            proc.kill()
            out, err = proc.communicate()
        outs.append(out)
        errs.append(err)
        rcs.append(proc.returncode)
    res = PlainResult(rcs, "".join(outs), "".join(errs), time.monotonic() - start)
    if late:
        raise MpiTimeout(f"{n} plain ranks ran past {timeout} s", res.output)
    return res
