"""tests/mpi_helpers.py's MPS check, which decides whether GPU tests whose ranks share a GPU run or skip."""
from __future__ import annotations

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
