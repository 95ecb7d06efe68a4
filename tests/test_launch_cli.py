"""`kog launch`: launcher detection and commands (dry run, with fake launchers on PATH), and real runs
under the MPI that CI has (MPICH's mpiexec from the PyPI wheel): ranks, signals, endpoint file."""
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from launch import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")

HYDRA_VERSION = """HYDRA build details:
    Version:                                 4.1.2
    Release Date:                            Wed Jun  7 15:22:45 CDT 2023
    Process Manager:                         pmi
    Launchers available:                     ssh rsh fork slurm ll lsf sge manual persist
"""
OMPI4_VERSION = "mpirun (Open MPI) 4.1.5\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
OMPI5_VERSION = "mpirun (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/\n"
SRUN_VERSION = "slurm 22.05.8\n"


def fake_bin(tmp_path, **scripts):
    """A PATH dir with tiny shell scripts: name -> text printed for --version."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, version in scripts.items():
        f = d / name
        f.write_text("#!/bin/sh\nif [ \"$1\" = --version ] || [ \"$1\" = -V ]; then\n"
                     f"cat <<'EOF'\n{version}EOF\nexit 0\nfi\necho \"fake {name} $*\"\n")
        f.chmod(0o755)
    return str(d)


def clean_env(path, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "KOG_LAUNCHER", "KOG_SRUN_MPI"))}
    # Only the fakes and `cat` (their helper) on PATH: a real launcher of the machine never shows.
    tools = os.path.join(os.path.dirname(path), "tools")
    os.makedirs(tools, exist_ok=True)
    if not os.path.exists(os.path.join(tools, "cat")):
        os.symlink(shutil.which("cat") or "/bin/cat", os.path.join(tools, "cat"))
    env["PATH"] = path + os.pathsep + tools
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def kog_launch(args, env, timeout=60):
    return subprocess.run([sys.executable, "-m", "launch.cli"] + args, cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


WORKER = ["kog-worker", "--model", "/m", "--control", "tcp://127.0.0.1:5555"]


# ---------------------------------------------------------------- dry runs

def test_dry_run_mpich(tmp_path):
    d = fake_bin(tmp_path, mpiexec=HYDRA_VERSION, mpirun=HYDRA_VERSION)
    p = kog_launch(["--np", "4", "--dry-run", "--"] + WORKER, clean_env(d))
    assert p.returncode == 0, p.stderr
    assert shlex.split(p.stdout.strip()) == [f"{d}/mpiexec", "-n", "4", "-bind-to", "none"] + WORKER


@pytest.mark.parametrize("version", [OMPI4_VERSION, OMPI5_VERSION])
def test_dry_run_openmpi_as_root(tmp_path, version, monkeypatch):
    # Open MPI installs mpiexec too; both answer "Open MPI".
    d = fake_bin(tmp_path, mpiexec=version, mpirun=version)
    p = kog_launch(["--np", "2", "--dry-run", "--"] + WORKER, clean_env(d))
    assert p.returncode == 0, p.stderr
    argv = shlex.split(p.stdout.strip())
    assert argv[:3] == [f"{d}/mpiexec", "-np", "2"]
    assert argv[-len(WORKER):] == WORKER
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    assert "--bind-to" in argv and argv[argv.index("--bind-to") + 1] == "none"
    n_cores = len(os.sched_getaffinity(0))
    assert ("--oversubscribe" in argv) == (2 > n_cores)


def test_dry_run_openmpi_oversubscribes_only_past_the_cores(tmp_path):
    d = fake_bin(tmp_path, mpirun=OMPI4_VERSION)   # only mpirun: mpiexec absent
    n_cores = len(os.sched_getaffinity(0))
    few = shlex.split(kog_launch(["--np", "1", "--dry-run", "--"] + WORKER, clean_env(d)).stdout)
    many = shlex.split(kog_launch(["--np", str(n_cores + 1), "--dry-run", "--"] + WORKER,
                                  clean_env(d)).stdout)
    assert few[0] == f"{d}/mpirun" and "--oversubscribe" not in few
    assert "--oversubscribe" in many


def test_openmpi_flags_by_user_and_cores():
    ompi = cli.Launcher("openmpi", "/usr/bin/mpirun")
    user = cli.build_command(ompi, 8, ["w"], cores=16, root=False)
    assert user == ["/usr/bin/mpirun", "-np", "8", "--bind-to", "none", "w"]
    root = cli.build_command(ompi, 8, ["w"], cores=4, root=True)
    assert root == ["/usr/bin/mpirun", "-np", "8", "--allow-run-as-root", "--oversubscribe",
                    "--bind-to", "none", "w"]
    mpich = cli.build_command(cli.Launcher("mpich", "mpiexec"), 8, ["w"], cores=2, root=True)
    assert mpich == ["mpiexec", "-n", "8", "-bind-to", "none", "w"]


def test_dry_run_srun_inside_allocation(tmp_path):
    d = fake_bin(tmp_path, srun=SRUN_VERSION, mpiexec=HYDRA_VERSION)
    env = clean_env(d, SLURM_JOB_ID="42", SLURM_NTASKS="8", SLURM_CPUS_ON_NODE="16")
    p = kog_launch(["--np", "8", "--dry-run", "--"] + WORKER, env)
    assert p.returncode == 0, p.stderr
    argv = shlex.split(p.stdout.strip())
    assert argv[:4] == [f"{d}/srun", "--mpi=pmi2", "-n", "8"]
    assert "--nodes=1" in argv and "--cpu-bind=none" in argv and "--overcommit" not in argv
    assert argv[-len(WORKER):] == WORKER
    # pmix when asked; --overcommit when the tasks outnumber the allocated CPUs
    p = kog_launch(["--np", "4", "--srun-mpi", "pmix", "--dry-run", "--"] + WORKER,
                   clean_env(d, SLURM_JOB_ID="42", SLURM_CPUS_ON_NODE="2"))
    argv = shlex.split(p.stdout.strip())
    assert "--mpi=pmix" in argv and "--overcommit" in argv


def test_dry_run_srun_only_inside_an_allocation(tmp_path):
    d = fake_bin(tmp_path, srun=SRUN_VERSION, mpiexec=HYDRA_VERSION)
    p = kog_launch(["--np", "2", "--dry-run", "--"] + WORKER, clean_env(d))  # no SLURM_JOB_ID
    assert shlex.split(p.stdout)[0] == f"{d}/mpiexec"
    # --launcher mpi never picks srun, even inside an allocation
    p = kog_launch(["--np", "2", "--launcher", "mpi", "--dry-run", "--"] + WORKER,
                   clean_env(d, SLURM_JOB_ID="42"))
    assert shlex.split(p.stdout)[0] == f"{d}/mpiexec"


def test_no_launcher_is_a_clear_error(tmp_path):
    d = fake_bin(tmp_path, mpiexec="some other tool 1.0\n")
    p = kog_launch(["--np", "2", "--dry-run", "--"] + WORKER, clean_env(d))
    assert p.returncode == 2
    assert "no launcher found" in p.stderr and "pip install mpich" in p.stderr
    p = kog_launch(["--np", "2", "--launcher", "openmpi", "--dry-run", "--"] + WORKER,
                   clean_env(fake_bin(tmp_path, mpiexec=HYDRA_VERSION)))
    assert p.returncode == 2 and "no openmpi" in p.stderr


def test_nothing_to_launch(tmp_path):
    p = kog_launch(["--np", "2", "--dry-run"], clean_env(fake_bin(tmp_path, mpiexec=HYDRA_VERSION)))
    assert p.returncode == 2 and "nothing to launch" in p.stderr


def test_classify():
    assert cli.classify(HYDRA_VERSION) == "mpich"
    assert cli.classify(OMPI4_VERSION) == "openmpi"
    assert cli.classify("mpirun (Open MPI) 3.1.3\n") == "openmpi"
    assert cli.classify("Intel(R) MPI Library for Linux* OS, Version 2021.9") == "mpich"
    assert cli.classify("whatever") is None


def test_endpoint_helpers():
    assert cli.control_endpoint(["w", "--control", "tcp://127.0.0.1:5"]) == "tcp://127.0.0.1:5"
    assert cli.control_endpoint(["w", "--control=tcp://h:6"]) == "tcp://h:6"
    assert cli.control_endpoint(["w"]) is None
    assert cli.parse_tcp("tcp://127.0.0.1:5555") == ("127.0.0.1", 5555)
    assert cli.public_endpoint("tcp://127.0.0.1:7") == "tcp://127.0.0.1:7"
    assert not cli.public_endpoint("tcp://0.0.0.0:7").startswith("tcp://0.0.0.0")
    with pytest.raises(cli.LaunchError):
        cli.parse_tcp("ipc:///tmp/x")


# ---------------------------------------------------------------- real runs (MPICH from the wheel)

def real_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "KOG_LAUNCHER", "MPIR_CVAR"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@needs_mpiexec
@pytest.mark.mpi
def test_real_run_under_mpiexec():
    p = kog_launch(["--np", "2", "--", sys.executable, "-m", "launch.discovery"], real_env())
    assert p.returncode == 0, p.stderr
    assert "kog launch (mpich)" in p.stderr
    rows = sorted((json.loads(m) for m in re.findall(r"\{[^{}]*\}", p.stdout)),
                  key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["local_rank"], r["local_size"]) for r in rows] == \
        [(0, 2, 0, 2), (1, 2, 1, 2)]


@needs_mpiexec
@pytest.mark.mpi
def test_real_run_returns_the_exit_code():
    prog = "import os, sys; sys.exit(7 if os.environ.get('PMI_RANK') == '1' else 0)"
    p = kog_launch(["--np", "2", "--", sys.executable, "-c", prog], real_env())
    assert p.returncode == 7, (p.returncode, p.stderr)


RANK_PROG = textwrap.dedent("""
    import os, signal, socket, sys, time
    from mpi4py import MPI
    r = MPI.COMM_WORLD.Get_rank()
    got = []
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda n, f: got.append(n))
    srv = None
    if r == 0 and len(sys.argv) > 1:          # a stand-in for rank 0's control plane
        srv = socket.socket(); srv.bind(("127.0.0.1", int(sys.argv[1]))); srv.listen()
    MPI.COMM_WORLD.Barrier()
    print(f"ready {r}", flush=True)
    t = time.monotonic()
    while not got and time.monotonic() - t < 60:
        time.sleep(0.05)
    print(f"rank {r} got {got}", flush=True)
    sys.exit(0 if got else 3)
""")


def _wait_for(pred, timeout, what):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@needs_mpiexec
@pytest.mark.mpi
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_to_every_rank(tmp_path, sig):
    prog = tmp_path / "rank.py"
    prog.write_text(RANK_PROG)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "--np", "2", "--",
                                 sys.executable, str(prog)], cwd=REPO, env=real_env(),
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_for(lambda: out.read_text().count("ready") == 2, 60, "both ranks ready")
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    assert rc == 0, text
    assert f"rank 0 got [{int(sig)}" in text and f"rank 1 got [{int(sig)}" in text, text


@needs_mpiexec
@pytest.mark.mpi
def test_endpoint_file_written_when_listening_and_removed_at_exit(tmp_path):
    prog = tmp_path / "rank.py"
    prog.write_text(RANK_PROG)
    port = cli.free_port()
    ep = tmp_path / "ep" / "endpoint"
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "--np", "2", "--endpoint-file", str(ep), "--",
             sys.executable, str(prog), str(port), "--control", f"tcp://127.0.0.1:{port}"],
            cwd=REPO, env=real_env(), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_for(ep.exists, 60, "the endpoint file")
        assert ep.read_text().strip() == f"tcp://127.0.0.1:{port}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not ep.exists()


def test_kog_launch_subcommand(tmp_path):
    # `kog launch` reaches launch.cli.main through the kog CLI.
    d = fake_bin(tmp_path, mpiexec=HYDRA_VERSION)
    p = subprocess.run([sys.executable, "-c", "import sys; from kog_cli.cli import main; "
                        "sys.exit(main())", "launch", "--np", "3", "--dry-run", "--"] + WORKER,
                       cwd=REPO, env=clean_env(d), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert shlex.split(p.stdout.strip()) == [f"{d}/mpiexec", "-n", "3", "-bind-to", "none"] + WORKER


def test_np_defaults_to_the_allocation_inside_slurm(tmp_path):
    d = fake_bin(tmp_path, srun=SRUN_VERSION)
    p = kog_launch(["--dry-run", "--"] + WORKER, clean_env(d, SLURM_JOB_ID="5", SLURM_NTASKS="4"))
    assert p.returncode == 0, p.stderr
    assert shlex.split(p.stdout)[:4] == [f"{d}/srun", "--mpi=pmi2", "-n", "4"]
    p = kog_launch(["--dry-run", "--"] + WORKER, clean_env(d))
    assert p.returncode == 2 and "--np N is required" in p.stderr


def test_free_port_is_below_the_ephemeral_range():
    """A port an outgoing connection cannot take before the server binds it (nor a client waiting for the
    server connect its socket to itself there): below the kernel's ephemeral range, and free."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = {cli.free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1, (ports, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
