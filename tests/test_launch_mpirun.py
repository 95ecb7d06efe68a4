"""launch/mpirun-serve.sh under PATH's mpiexec (MPICH's or Open MPI's): 2 and 4 ranks come up, each
bound to the cores the topology plan gave it (read back from the OS), serve the reference ids, and
stop on SIGTERM."""
import json
import os
import shutil
import signal
import subprocess

import pytest

from launch.cli import detect
from test_launch_helpers import (REPO, affinity, client_generate, env, kill_all, kog, procs_with,
                                 ranks_with, reference_ids, tiny_model, wait_for)

SCRIPT = os.path.join(REPO, "launch", "mpirun-serve.sh")
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(shutil.which("mpiexec") is None,
                                 reason="no mpiexec on PATH (pip install mpich)")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = tiny_model(tmp_path_factory.mktemp("launch-mpirun") / "tiny4", lanes=4)
    return m, reference_ids(m)


def planned_cores(n):
    p = kog(["topo", "--ranks", str(n), "--cpu", "--json"], timeout=60)   # the ranks run the cpu backend
    return {e["rank"]: sorted(e["cores"]) for e in json.loads(p.stdout)["plan"]["ranks"]}


@pytest.mark.parametrize("n", [2, 4])
def test_mpirun_serve_binds_ranks_to_the_plan(tmp_path, model, n):
    model_dir, ref = model
    ep = tmp_path / "endpoint"
    log = tmp_path / "serve.log"
    plan = planned_cores(n)
    assert sorted(plan) == list(range(n))
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", SCRIPT, "-n", str(n), "--model", model_dir,
                                 "--backend", "cpu", "--endpoint-file", str(ep)],
                                cwd=tmp_path, env=env(), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: ep.exists() or proc.poll() is not None, 120, "the control endpoint")
        assert proc.poll() is None, f"mpirun-serve.sh exited {proc.returncode}:\n{log.read_text()}"
        text = log.read_text()
        kind = detect(env(), prefer="mpi").kind         # the script's launcher: PATH's mpiexec
        assert f"kog launch ({kind})" in text and "-bind-to none" in text, text
        assert ("-disable-auto-cleanup" if kind == "mpich" else "--runtime-options" if
                "--runtime-options" in text else "odls_base_sigkill_timeout") in text, text

        ranks = wait_for(lambda: (r := ranks_with(model_dir)) and len(r) == n and r, 30,
                         f"{n} rank processes")
        # Each rank bound itself to its planned cores; read back from the OS.
        def bound():
            return all(affinity(ranks[r]) == plan[r] for r in range(n))
        try:
            wait_for(bound, 30, "ranks bound to the plan")
        except AssertionError:
            got = {r: affinity(pid) for r, pid in ranks.items()}
            raise AssertionError(f"affinity {got} != plan {plan}\n{log.read_text()}")

        assert client_generate(ep.read_text().strip()) == ref

        proc.send_signal(signal.SIGTERM)                  # kog launch forwards it (Open MPI: to the ranks)
        rc = proc.wait(timeout=60)
        assert rc == 0, f"exit {rc} after SIGTERM:\n{log.read_text()}"
        wait_for(lambda: not procs_with(model_dir), 15, "every rank gone")
        assert not ep.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_all(model_dir)


def test_mpirun_serve_usage_errors(tmp_path):
    p = subprocess.run(["bash", SCRIPT, "--model", "x"], env=env(), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=30)
    assert p.returncode == 2 and "-n N is required" in p.stderr
    p = subprocess.run(["bash", SCRIPT, "-n", "two", "--model", "x"], env=env(),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=30)
    assert p.returncode == 2 and "positive integer" in p.stderr


def test_mpirun_serve_refuses_ranks_not_dividing_lanes(tmp_path, model):
    model_dir, _ = model
    p = subprocess.run(["bash", SCRIPT, "-n", "3", "--model", model_dir, "--backend", "cpu"],
                       cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, stdin=subprocess.DEVNULL, timeout=90)
    try:
        assert p.returncode != 0
        assert "3 ranks do not divide num_lanes=4" in p.stdout, p.stdout
    finally:
        kill_all(model_dir)


def test_mpirun_serve_with_open_mpi_builds_its_command(tmp_path):
    # A fake `mpirun` (and `mpiexec`) that answers --version as Open MPI 4.1 and echoes its arguments
    # shows the command the script runs with it.
    d = tmp_path / "bin"
    d.mkdir()
    fake = d / "mpirun"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'mpirun (Open MPI) 4.1.5'; "
                    "exit 0; fi\necho \"FAKE-MPIRUN $*\"\n")
    fake.chmod(0o755)
    os.symlink(fake, d / "mpiexec")      # found before a real mpiexec further down PATH
    e = env(KOG_LAUNCHER="openmpi", KOG_PORT="45678")
    e["PATH"] = f"{d}{os.pathsep}{e['PATH']}"
    p = subprocess.run(["bash", SCRIPT, "-n", "2", "--model", "/m", "--backend", "cpu"],
                       cwd=tmp_path, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, stdin=subprocess.DEVNULL, timeout=90)
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("FAKE-MPIRUN"))
    argv = line.split()[1:]
    assert argv[:2] == ["-np", "2"]
    assert argv[argv.index("--mca") + 1:][:2] == ["odls_base_sigkill_timeout", "2"]   # --keep-survivors, 4.1
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    assert ("--oversubscribe" in argv) == (2 > len(os.sched_getaffinity(0)))
    i = argv.index("--bind-to")
    assert argv[i + 1] == "none"
    rest = argv[i + 2:]
    assert rest[-8:] == ["--model", "/m", "--control", "tcp://127.0.0.1:45678", "--bind", "cores",
                         "--backend", "cpu"], rest
