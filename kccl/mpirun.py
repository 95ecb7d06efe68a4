"""Finding `mpiexec`, the environment it needs as root, and telling whether this process already runs
under an MPI launcher.

The `mpich` wheel from PyPI installs `mpiexec` next to the interpreter (its scripts folder), so that
one is preferred to whatever PATH offers (a pyenv shim, or a system MPI that mpi4py was not built for).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig

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
