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


HYDRA = "HYDRA build details:\n    Version:                                 4.2.0\n    Release Date: ...\n"
ORTE = "mpiexec (OpenRTE) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
PRRTE = "mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n"


def test_flavor_and_the_flags_that_keep_survivors():
    from kccl.mpirun import Flavor, keep_survivors_args, parse_flavor
    assert parse_flavor(HYDRA) == Flavor("mpich", (4, 2))
    assert parse_flavor(ORTE) == Flavor("openmpi", (4, 1))
    assert parse_flavor(PRRTE) == Flavor("openmpi", (5, 0))
    assert parse_flavor("srun: slurm 23.02") is None
    assert keep_survivors_args(parse_flavor(HYDRA)) == ["-disable-auto-cleanup"]
    assert keep_survivors_args(parse_flavor(ORTE)) == ["--mca", "odls_base_sigkill_timeout", "2"]
    assert keep_survivors_args(parse_flavor(PRRTE)) == ["--runtime-options", "recoverable"]


def test_rank_of_reads_either_launchers_variable():
    from kccl.mpirun import rank_of
    assert rank_of({"PMI_RANK": "3"}) == 3
    assert rank_of({b"OMPI_COMM_WORLD_RANK": b"1", b"PATH": b"/bin"}) == 1
    assert rank_of({"PATH": "/bin"}) is None


def test_mpiexec_command_of_each_flavor(tmp_path):
    """Open MPI gets hydra's defaults spelled out (no binding; more ranks than cores allowed); the
    flavor comes from the launcher's own --version (fake launchers here)."""
    from kccl.mpirun import mpiexec_command
    for name, text in (("hydra", HYDRA), ("orte", ORTE)):
        fake = tmp_path / name
        fake.write_text(f"#!/bin/sh\ncat <<'X'\n{text}X\n")
        fake.chmod(0o755)
    assert mpiexec_command(4, mpiexec=str(tmp_path / "hydra"), cores=2) == [str(tmp_path / "hydra"), "-n", "4"]
    assert mpiexec_command(4, keep_survivors=True, mpiexec=str(tmp_path / "orte"), cores=2) == [
        str(tmp_path / "orte"), "-n", "4", "--bind-to", "none", "--oversubscribe",
        "--mca", "odls_base_sigkill_timeout", "2"]
    assert "--oversubscribe" not in mpiexec_command(2, mpiexec=str(tmp_path / "orte"), cores=2)


def test_keep_survivors_leaves_the_others_running(tmp_path):
    """What the tests' auto_cleanup=False relies on, with this machine's mpiexec: rank 1 dies, rank 0
    goes on and ends the job itself, and the launcher still exits non-zero. Rank 1 dies as a
    kog-worker rank does: of SIGKILL under Open MPI, as exit 137 under MPICH (hydra SIGKILLs every
    rank when one dies of a signal; workers/keeper.py turns that death into this exit code)."""
    if not mpi_helpers.have_mpiexec():
        pytest.skip("no mpiexec")
    code = ("import os, signal, sys, time; from mpi4py import MPI; w = MPI.COMM_WORLD; w.Barrier()\n"
            "from kccl.shm import unlink_mpich_segments; unlink_mpich_segments()\n"   # nothing left in /dev/shm
            "if w.rank == 1:\n"
            "    os.kill(os.getpid(), signal.SIGKILL) if sys.argv[1] == 'openmpi' else os._exit(137)\n"
            "time.sleep(1.5); sys.stdout.write(f'SURVIVED {w.rank}\\n'); sys.stdout.flush(); os._exit(1)\n")
    kind = mpi_helpers.flavor().kind
    res = mpi_helpers.run_mpi(2, code=code, args=(kind,), timeout=60, auto_cleanup=False)
    assert res.marks("SURVIVED") == [0] and res.returncode != 0, res.output


def test_signal_job_reaches_every_rank_and_the_job_ends_cleanly(tmp_path):
    """A graceful stop (what kog launch forwards): under MPICH mpiexec forwards SIGTERM; Open MPI's
    mpirun would take it as an abort (SIGKILL moments later, exit 1), so there the ranks get it.
    Either way every rank sees it and mpiexec exits 0."""
    if not mpi_helpers.have_mpiexec():
        pytest.skip("no mpiexec")
    import signal as sig
    import sys
    from kccl.mpirun import signal_job
    code = ("import signal, sys, time; from mpi4py import MPI; w = MPI.COMM_WORLD\n"
            "got = []; signal.signal(signal.SIGTERM, lambda *a: got.append(1)); w.Barrier()\n"
            "sys.stdout.write(f'READY {w.rank}\\n'); sys.stdout.flush()\n"
            "t = time.monotonic()\n"
            "while not got and time.monotonic() - t < 30: time.sleep(0.02)\n"
            "sys.stdout.write(f'TERM {w.rank}\\n' if got else f'NOTERM {w.rank}\\n'); sys.stdout.flush()\n")
    out = tmp_path / "out"
    with open(out, "w") as f:
        p = subprocess.Popen(mpi_helpers.mpiexec_command(2) + [sys.executable, "-c", code], stdout=f,
                             stderr=subprocess.STDOUT, env=mpi_helpers.mpi_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while out.read_text().count("READY") < 2 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        signal_job(p.pid, sig.SIGTERM, mpi_helpers.flavor().kind)
        assert p.wait(30) == 0, out.read_text()
        text = out.read_text()
        assert "TERM 0" in text and "TERM 1" in text and "NOTERM" not in text, text
    finally:
        if p.poll() is None:
            os.killpg(p.pid, sig.SIGKILL)
            p.wait()
