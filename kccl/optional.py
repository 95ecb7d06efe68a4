"""kccl's lazy imports, in one place: what may be missing here or must not load on `import kccl`.

- mpi4py's MPI: importing it loads the MPI library and runs MPI_Init, which only a rank may do (a
  relauncher, the plain-process tests and the CUDA-only paths never touch MPI);
- CuPy (and its NCCL binding): only the cuda_ipc transport needs a GPU, and CPU machines have none.

Each function imports on every call (a dictionary lookup once loaded), so a fake `cupy` put into
sys.modules by the CPU tests is the one returned.
"""

from __future__ import annotations

import subprocess
import sys

MPI_HINT = "pip install mpich (or point MPI4PY_LIBMPI at the libmpi of an installed MPI)"


class MpiMissing(RuntimeError):
    """mpi4py cannot load an MPI library here; the message is one line that says what to install."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def mpi():
    """mpi4py's MPI module (initialised), or MpiMissing when no MPI library can be loaded."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:   # mpi4py absent; "cannot load MPI library"
        raise MpiMissing(f"MPI cannot be loaded ({_first_line(exc)}): {MPI_HINT}") from None
    return MPI


_PROBE = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI"


def mpi_missing() -> str | None:
    """Why ranks started here could not load MPI (None: they can). Probed in a child process, where
    mpi4py loads the library without MPI_Init, so that the caller (a launcher) stays free of MPI."""
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"MPI could not be probed ({_first_line(exc)})"
    if p.returncode == 0:
        return None
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    reason = next((ln for ln in lines if "cannot load MPI library" in ln or "No module named" in ln),
                  lines[-1] if lines else f"exit {p.returncode}")
    reason = reason.split(": ", 1)[1] if reason.startswith(("RuntimeError: ", "ModuleNotFoundError: ")) else reason
    return f"MPI cannot be loaded ({reason.strip()}): {MPI_HINT}"


def cupy():
    """The cupy module (ImportError where it is not installed)."""
    import cupy

    return cupy


def nccl():
    """cupy.cuda.nccl (ImportError where CuPy was built without it)."""
    from cupy.cuda import nccl

    return nccl
