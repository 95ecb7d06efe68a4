"""A frozen rank (SIGSTOP) under the real mpiexec: its heartbeat stops, rank 0 tells every client
backend_failed naming the rank within 5 s, and the whole job (the frozen rank too) is gone within
10 s with nothing left in /dev/shm; with the launcher's default cleanup and with the flags that keep
survivors (kccl.mpirun.keep_survivors_args: MPICH's -disable-auto-cleanup, Open MPI's MCA or runtime
option). A rank SIGKILLed with survivors kept reaches the clients as backend_failed too, not as a
lost server: under MPICH hydra's proxy SIGKILLs every rank as soon as one dies *of a signal*, so each
rank runs under a keeper process that turns that death into an exit code (workers/keeper.py); Open
MPI's flag leaves them running by itself."""
from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from kog_dist.client import Client, ServerError

from test_control_helpers import tiny_model, wait_until
from test_control_mpi import PROMPT, Job, _alive

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("frozen") / "m"))


@pytest.fixture
def prefix(monkeypatch):
    """The job's kccl and heartbeat segments get a name of their own, to look for afterwards."""
    p = f"kogfrozen{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KCCL_SHM_PREFIX", p)
    return p


def _left_in_shm(prefix):
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def _running_and_queued(endpoint):
    a, b = Client(endpoint, timeout=30), Client(endpoint, timeout=30)
    sa = a.stream(prompt_ids=PROMPT, max_new_tokens=900)
    next(sa)
    sb = b.stream(prompt_ids=PROMPT, max_new_tokens=4)
    sb._step()
    return (a, b), (sa, sb)


def _expect_backend_failed(streams, rank, t0, within):
    for s in streams:
        with pytest.raises(ServerError) as e:
            list(s)
        assert e.value.code == "backend_failed" and f"rank {rank}" in e.value.message, e.value
    took = time.monotonic() - t0
    assert took < within, f"clients told after {took:.1f} s"


@pytest.mark.parametrize("auto_cleanup", [True, False], ids=["launcher-cleanup", "survivors-kept"])
def test_sigstopped_rank_mid_decode(model, prefix, auto_cleanup):
    job = Job(model, 2, auto_cleanup=auto_cleanup)
    try:
        assert not _left_in_shm(prefix), "segments are unlinked once every rank mapped them"
        clients, streams = _running_and_queued(job.endpoint)
        os.kill(job.ranks[1], signal.SIGSTOP)
        t0 = time.monotonic()
        _expect_backend_failed(streams, 1, t0, 5.0)
        for c in clients:
            c.close()
        assert job.wait(max(0.5, t0 + 10 - time.monotonic())) != 0
        assert wait_until(lambda: not any(_alive(p) for p in job.pids), max(0.5, t0 + 10 - time.monotonic())), \
            f"processes left behind 10 s after the freeze\n{job.output()}"
        assert not _left_in_shm(prefix)
        job.assert_gone(within=0.5)      # and the MPI library's own segments are gone too
        out = job.output()
        assert "Traceback" not in out and "rank 1" in out and "stopped responding" in out, out
    finally:
        job.kill()


def test_sigstopped_rank_while_idle(model, prefix):
    job = Job(model, 2, auto_cleanup=False)
    try:
        os.kill(job.ranks[1], signal.SIGSTOP)
        t0 = time.monotonic()
        assert job.wait(10) != 0
        assert time.monotonic() - t0 < 10
        job.assert_gone()
        assert not _left_in_shm(prefix) and "Traceback" not in job.output()
    finally:
        job.kill()


def test_killed_rank_survivors_kept_reports_backend_failed(model, prefix):
    job = Job(model, 2, auto_cleanup=False)
    try:
        clients, streams = _running_and_queued(job.endpoint)
        os.kill(job.ranks[1], signal.SIGKILL)
        _expect_backend_failed(streams, 1, time.monotonic(), 5.0)
        for c in clients:
            c.close()
        assert job.wait(10) != 0
        job.assert_gone()
        assert not _left_in_shm(prefix) and "Traceback" not in job.output()
    finally:
        job.kill()


def test_sigstopped_rank_0_ends_the_job(model, prefix, monkeypatch):
    """Rank 0 frozen: nobody can tell the clients, but the followers (after 4 x the heartbeat deadline,
    1 s here) end the job, the stopped rank 0 included."""
    monkeypatch.setenv("KOG_HEARTBEAT_S", "1")
    job = Job(model, 2, auto_cleanup=False)
    try:
        os.kill(job.ranks[0], signal.SIGSTOP)
        t0 = time.monotonic()
        assert job.wait(10) != 0 and time.monotonic() - t0 < 10
        job.assert_gone()
        assert not _left_in_shm(prefix) and "rank 0" in job.output() and "stopped" in job.output()
    finally:
        job.kill()
