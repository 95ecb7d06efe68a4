"""tests/mpi_helpers.py's MPS check, which decides whether GPU tests whose ranks share a GPU run or skip."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

import mpi_helpers


def test_mps_daemon_is_seen_by_its_process_name(tmp_path, monkeypatch):
    monkeypatch.delenv("KOG_TEST_MPS", raising=False)
    if mpi_helpers.mps_running():
        pytest.skip("an MPS daemon runs on this machine")
    fake = tmp_path / "nvidia-cuda-mps-control"      # /proc/PID/comm keeps 15 characters of this name
    shutil.copy(shutil.which("sleep"), fake)
    p = subprocess.Popen([str(fake), "30"])
    try:
        deadline = time.monotonic() + 5
        while not mpi_helpers.mps_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mpi_helpers.mps_running()
    finally:
        p.kill()
        p.wait()
    assert not mpi_helpers.mps_running()


def test_mps_can_be_declared(monkeypatch):
    monkeypatch.setenv("KOG_TEST_MPS", "1")
    assert mpi_helpers.mps_running()


def test_launches_as_root_carry_open_mpis_permission():
    """Open MPI's mpirun refuses root without OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM); every test launch gets
    them as root (mpi_env), and only as root."""
    from kccl.mpirun import ROOT_ENV, launcher_env
    assert launcher_env({"A": "1"}, root=True) == {"A": "1", **ROOT_ENV}
    assert launcher_env({"A": "1"}, root=False) == {"A": "1"}
    if os.geteuid() == 0:
        assert ROOT_ENV.items() <= mpi_helpers.mpi_env().items()


def test_a_launch_with_the_root_variables_runs(tmp_path):
    """MPICH's hydra ignores Open MPI's root variables: the same environment serves both launchers."""
    if not mpi_helpers.have_mpiexec():
        pytest.skip("no mpiexec")
    # one write a rank: under PYTHONUNBUFFERED (CI) print's pieces of two ranks can interleave ("OKOK 0 1")
    code = "import sys; from mpi4py import MPI; sys.stdout.write(f'OK {MPI.COMM_WORLD.rank}\\n')"
    res = mpi_helpers.run_mpi(2, code=code, timeout=60,
                              env={"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    assert res.returncode == 0 and res.marks("OK") == [0, 1], res.output
