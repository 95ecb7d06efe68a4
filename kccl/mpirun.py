"""Finding `mpiexec`, the environment it needs as root, telling whether this process already runs
under an MPI launcher, and what differs between MPICH's and Open MPI's launchers (``flavor``,
``keep_survivors_args``, ``RANK_ENV``): the one place that knows.

The `mpich` wheel from PyPI installs `mpiexec` next to the interpreter (its scripts folder), so that
one is preferred to whatever PATH offers (a pyenv shim, or a system MPI that mpi4py was not built for).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass

_LAUNCHER_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS",
                 "HYDI_CONTROL_FD")

# Open MPI's mpirun refuses to start ranks as root unless both are set (the environment form of
# --allow-run-as-root); MPICH's hydra ignores them. Every launch the project builds goes through
# launcher_env (kccl.bench's relaunch, the tests' mpi_helpers) or launch.cli.build_command (the flag).
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def find_mpiexec() -> str:
    """Path of mpiexec: env KCCL_MPIEXEC, the interpreter's scripts folder, then PATH."""
    explicit = os.environ.get("KCCL_MPIEXEC")
    if explicit:
        return explicit
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = os.path.join(folder, "mpiexec")
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("mpiexec not found: pip install mpich (or put an MPI's mpiexec on PATH)")
    return found


def under_mpi() -> bool:
    """True when a launcher (mpiexec/mpirun/srun with PMI) started this process."""
    return any(name in os.environ for name in _LAUNCHER_ENV)


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def launcher_env(env=None, *, root: bool | None = None) -> dict:
    """A copy of `env` (default os.environ) that lets mpiexec/mpirun start ranks: as root, ROOT_ENV added."""
    out = dict(os.environ if env is None else env)
    if is_root() if root is None else root:
        out.update(ROOT_ENV)
    return out


# The variable each launcher sets to the rank's number in the world (rank_of reads any of them).
RANK_ENV = {"mpich": "PMI_RANK", "openmpi": "OMPI_COMM_WORLD_RANK"}


@dataclass(frozen=True)
class Flavor:
    """Which implementation an mpiexec belongs to: kind 'mpich' or 'openmpi', its version (0, 0) when
    the --version text gave none."""
    kind: str
    version: tuple[int, int] = (0, 0)


def parse_flavor(version_text: str) -> Flavor | None:
    """Flavor from an mpiexec's --version output: hydra ("HYDRA build details: Version: 4.2.0"),
    Open MPI 4 ("mpiexec (OpenRTE) 4.1.6"), Open MPI 5 ("mpiexec (Open MPI) 5.0.11"); None otherwise."""
    t = version_text.lower()
    if "open mpi" in t or "openrte" in t or "open-mpi.org" in t or "prrte" in t:
        kind = "openmpi"
        m = re.search(r"\((?:open ?mpi|openrte)\)\s*v?(\d+)\.(\d+)", t) or re.search(r"(\d+)\.(\d+)", t)
    elif "hydra" in t or "mpich" in t or "intel(r) mpi" in t:
        kind = "mpich"
        m = re.search(r"version:\s*(\d+)\.(\d+)", t)
    else:
        return None
    return Flavor(kind, (int(m.group(1)), int(m.group(2))) if m else (0, 0))


@functools.lru_cache(maxsize=8)
def _flavor_of(path: str) -> Flavor:
    try:
        p = subprocess.run([path, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, text=True, timeout=30, env=launcher_env())
        text = p.stdout or ""
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{path} --version failed: {e}") from None
    got = parse_flavor(text)
    if got is None:
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "no output")
        raise RuntimeError(f"{path} is neither MPICH's nor Open MPI's mpiexec ({first})")
    return got


def flavor(mpiexec: str | None = None) -> Flavor:
    """The implementation of `mpiexec` (default find_mpiexec()), from its --version (asked once)."""
    return _flavor_of(mpiexec or find_mpiexec())


def keep_survivors_args(fl: Flavor) -> list[str]:
    """mpiexec flags that leave the other ranks running when one rank dies, so that rank 0 can tell
    its clients (backend_failed) and end the job itself.

    MPICH's hydra: -disable-auto-cleanup (a rank that dies *of a signal* still gets the others
    SIGKILLed by hydra's proxy: workers/keeper.py turns such a death into an exit code).

    Open MPI 5 (PRRTE): `--runtime-options recoverable`: a rank killed by a signal no longer ends
    the job, and mpirun exits with the status of the ranks that exit (measured with 5.0.11); a
    non-zero exit still ends it, which here only follows the failure rank 0 already reported.

    Open MPI 4 (ORTE) has no such mode that works: with orte_abort_on_non_zero_status 0 the others
    live on, but once a rank has died of a signal mpirun never exits after the last rank left with a
    non-zero status (measured with 4.1.8: hangs), and --enable-recovery makes mpirun exit 0 whatever
    the ranks did. So it keeps the default (the job is ended when a rank dies) and stretches the
    ending: mpirun sends SIGCONT, waits odls_base_sigkill_timeout (default 1 s), SIGTERM, waits
    again, SIGKILL, and waits out both even when the ranks are gone already. At 2 s rank 0 has 2 s
    undisturbed (it sees a dead rank within a second: kccl, or its heartbeat check) and 2 more after
    the SIGTERM, which it takes for a failed peer first (kog_dist/coordinator.py); the job is over
    ~4 s after the last rank left, within the 10 s a frozen rank (found at 3 s) is allowed; 5 s
    made that 13 s. mpirun still exits non-zero."""
    if fl.kind == "mpich":
        return ["-disable-auto-cleanup"]
    if fl.kind == "openmpi":
        if fl.version >= (5, 0):
            return ["--runtime-options", "recoverable"]
        return ["--mca", "odls_base_sigkill_timeout", "2"]
    raise ValueError(f"unknown MPI flavor {fl.kind!r}")


def rank_of(env) -> int | None:
    """The world rank a launcher gave the process whose environment is `env` (str or bytes keys and
    values, e.g. parsed from /proc/PID/environ), or None."""
    for name in RANK_ENV.values():
        for key in (name, name.encode()):
            if key in env:
                try:
                    return int(env[key])
                except (TypeError, ValueError):
                    return None
    return None


def mpiexec_command(n: int, *, keep_survivors: bool = False, mpiexec: str | None = None,
                    cores: int | None = None) -> list[str]:
    """`mpiexec -n N` with what its flavor needs to behave as hydra does by default: Open MPI gets
    --bind-to none (hydra binds nothing; the ranks place themselves) and --oversubscribe when N
    exceeds the cores this process may use (it refuses to start more ranks than slots otherwise).
    keep_survivors adds keep_survivors_args."""
    path = mpiexec or find_mpiexec()
    fl = flavor(path)
    cmd = [path, "-n", str(n)]
    if fl.kind == "openmpi":
        cmd += ["--bind-to", "none"]
        if n > (cores if cores is not None else len(os.sched_getaffinity(0))):
            cmd.append("--oversubscribe")
    if keep_survivors:
        cmd += keep_survivors_args(fl)
    return cmd


def _children(pid: int) -> list[int]:
    out = []
    for q in os.listdir("/proc"):
        if q.isdigit():
            try:
                with open(f"/proc/{q}/stat", "rb") as f:
                    stat = f.read()
                if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
                    out.append(int(q))
            except (OSError, ValueError, IndexError):
                pass
    return out


def signal_job(pid: int, sig: int, kind: str) -> list[int]:
    """Deliver `sig` (SIGTERM, SIGINT, SIGHUP) to the job whose launcher is process `pid` so that
    its ranks see it, and return the pids signalled. hydra and srun forward it to every rank.
    Open MPI's mpirun takes it as an abort instead (SIGCONT, a grace, SIGTERM, a grace, SIGKILL:
    1 s + 1 s under 4.1, 0.2 s + 0.2 s under 5.0; exit 1), which leaves rank 0 no time to drain; so
    under it (kind 'openmpi') the ranks, mpirun's children on this node (each in a process group
    of its own), get it directly, and mpirun exits with their status; mpirun itself only when it
    has no children."""
    targets = _children(pid) if kind == "openmpi" else []
    for q in targets or [pid]:
        try:
            os.kill(q, sig)
        except ProcessLookupError:
            pass
    return targets or [pid]
