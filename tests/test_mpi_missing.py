"""Without a loadable MPI library every entry point says in one line what to install (no traceback), and
the default install (`pip install -e .`) brings one (mpich is a dependency, not an extra)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpi_helpers import REPO_ROOT, mpi_env

NO_MPI = {"MPI4PY_LIBMPI": "/nonexistent/libmpi.so"}   # mpi4py 4 loads the library named here, or fails


def _run(args, extra):
    env = mpi_env(extra)
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        env.pop(name, None)
    env.update(extra)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, env=env,
                          cwd=REPO_ROOT)


@pytest.mark.parametrize("args, extra", [
    (["-m", "kccl.bench", "-n", "2"], {}),                                  # the launcher side, before mpiexec
    (["-m", "kccl.bench"], {"PMI_RANK": "0", "PMI_SIZE": "1"}),             # a rank under a launcher
    (["-m", "workers", "--model", "tiny-random", "--oneshot", "{}"], {}),   # kog-worker
], ids=["kccl.bench", "kccl.bench-rank", "kog-worker"])
def test_no_mpi_library_gives_one_line_saying_what_to_install(args, extra):
    r = _run(args, {**NO_MPI, **extra})
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install mpich" in lines[0] and "cannot load MPI library" in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_the_default_install_loads_mpi():
    from kccl.optional import mpi_missing
    assert mpi_missing() is None
    assert "pip install mpich" in mpi_missing.__globals__["MPI_HINT"]
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("mpich") for d in deps), deps
