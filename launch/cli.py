"""``kog launch``: start N ranks with whichever launcher this machine has.

    kog launch --np N [--dry-run] [--launcher auto|mpich|openmpi|srun] [--keep-survivors] [--] kog-worker ARGS...

Picks the launcher that is present:
- inside a Slurm allocation (SLURM_JOB_ID set) with ``srun`` on PATH: ``srun --mpi=pmi2 -n N``
  (``--mpi`` from ``--srun-mpi`` or KOG_SRUN_MPI; pmi2 is what MPICH, including the PyPI wheel,
  speaks; pmix where the MPI and Slurm's pmix plugin support it);
- else ``mpiexec``/``mpirun`` on PATH, told apart by their ``--version`` output:
  MPICH (HYDRA) gets ``-n N -bind-to none``; Open MPI gets ``-np N --bind-to none``, plus
  ``--allow-run-as-root`` only when running as root and ``--oversubscribe`` only when N exceeds
  the cores this process may run on.
Launchers never bind: the ranks bind themselves to the topology module's plan (kog-worker --bind).
``--keep-survivors`` (a server's ranks) adds kccl.mpirun.keep_survivors_args: when a rank dies the
others run on (Open MPI 4.1: for a few seconds), so that rank 0 tells its clients backend_failed.

With ``--dry-run`` it prints the command and exits 0. Otherwise it runs it, forwards SIGINT,
SIGTERM and SIGHUP to it (under Open MPI the first one to the ranks: its mpirun takes them as an
abort), and returns its exit code (128+signal when it died of a signal).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from kccl.mpirun import Flavor, is_root, keep_survivors_args, parse_flavor, signal_job

LAUNCHERS = ("mpich", "openmpi", "srun")
CHOICES = ("auto", "mpi") + LAUNCHERS   # "mpi": mpiexec/mpirun of MPICH or Open MPI, never srun


class LaunchError(RuntimeError):
    pass


@dataclass
class Launcher:
    kind: str                 # "mpich" | "openmpi" | "srun"
    path: str                 # the executable
    version: str = ""         # first line of its --version
    notes: list[str] = field(default_factory=list)


def _version_output(exe: str, env: Mapping[str, str]) -> str:
    try:
        p = subprocess.run([exe, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, text=True, timeout=15, env=dict(env))
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return p.stdout or ""


def classify(version_text: str) -> Optional[str]:
    """'mpich', 'openmpi' or None from a launcher's --version output."""
    fl = parse_flavor(version_text)       # MPICH or Open MPI: kccl.mpirun knows their texts
    if fl is not None:
        return fl.kind
    t = version_text.lower()
    if re.search(r"\bslurm\b", t):
        return "srun"
    return None


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def detect(env: Optional[Mapping[str, str]] = None, prefer: str = "auto") -> Launcher:
    """The launcher to use. ``prefer``: 'auto', 'mpi' or one of LAUNCHERS."""
    env = os.environ if env is None else env
    path = env.get("PATH", os.defpath)
    if prefer not in CHOICES:
        raise LaunchError(f"unknown launcher {prefer!r}: pick one of {', '.join(CHOICES)}")

    if prefer in ("auto", "srun"):
        srun = shutil.which("srun", path=path)
        if prefer == "srun" and not srun:
            raise LaunchError("--launcher srun: no srun on PATH")
        if srun and (prefer == "srun" or env.get("SLURM_JOB_ID")):
            return Launcher("srun", srun, _first_line(_version_output(srun, env)))

    tried = []
    for name in ("mpiexec", "mpirun"):
        exe = shutil.which(name, path=path)
        if not exe:
            continue
        text = _version_output(exe, env)
        kind = classify(text)
        tried.append(f"{exe}: {_first_line(text) or 'no --version output'}")
        if kind in ("mpich", "openmpi") and prefer in ("auto", "mpi", kind):
            return Launcher(kind, exe, _first_line(text))
    if prefer in ("mpich", "openmpi"):
        raise LaunchError(f"--launcher {prefer}: no {prefer} mpiexec/mpirun on PATH"
                          + (f" (found {'; '.join(tried)})" if tried else ""))
    raise LaunchError("no launcher found: need MPICH's mpiexec (pip install mpich), Open MPI's "
                      "mpirun, or srun inside a Slurm allocation"
                      + (f" (found {'; '.join(tried)})" if tried else ""))


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def build_command(launcher: Launcher, np: int, cmd: Sequence[str], *,
                  cores: Optional[int] = None, root: Optional[bool] = None,
                  srun_mpi: str = "pmi2", env: Optional[Mapping[str, str]] = None,
                  extra: Sequence[str] = (), keep_survivors: bool = False) -> list[str]:
    """The full command line: launcher, its flags, then ``cmd``. keep_survivors (a server's ranks):
    when one rank dies, MPICH and Open MPI leave the others running (kccl.mpirun.keep_survivors_args),
    so that rank 0 tells its clients backend_failed and ends the job itself; srun's
    --kill-on-bad-exit is kept (it SIGTERMs, which rank 0 takes for a failed peer first)."""
    if np < 1:
        raise LaunchError(f"--np must be >= 1 (got {np})")
    if not cmd:
        raise LaunchError("nothing to launch: give the rank program, e.g. `kog launch --np 2 -- "
                          "kog-worker --model DIR --control tcp://127.0.0.1:5555`")
    env = os.environ if env is None else env
    cores = available_cores() if cores is None else cores
    root = is_root() if root is None else root
    k = launcher.kind
    if k == "mpich":
        # Hydra binds nothing unless asked; say so anyway, our ranks bind themselves.
        out = [launcher.path, "-n", str(np), "-bind-to", "none"]
    elif k == "openmpi":
        out = [launcher.path, "-np", str(np)]
        if root:
            out.append("--allow-run-as-root")
        if np > cores:
            out.append("--oversubscribe")
        out += ["--bind-to", "none"]
    elif k == "srun":
        out = [launcher.path, f"--mpi={srun_mpi}", "-n", str(np), "--nodes=1",
               "--cpu-bind=none", "--kill-on-bad-exit=1"]
        alloc = _slurm_cpus(env)
        if alloc is not None and np > alloc:
            out.append("--overcommit")
    else:  # pragma: no cover
        raise LaunchError(f"unknown launcher kind {k!r}")
    if keep_survivors and k in ("mpich", "openmpi"):
        out += keep_survivors_args(parse_flavor(launcher.version) or Flavor(k))
    return out + list(extra) + list(cmd)


def _slurm_cpus(env: Mapping[str, str]) -> Optional[int]:
    for name in ("SLURM_CPUS_ON_NODE", "SLURM_JOB_CPUS_PER_NODE"):
        v = env.get(name)
        if v:
            m = re.match(r"(\d+)", v)
            if m:
                return int(m.group(1))
    return None


def control_endpoint(cmd: Sequence[str]) -> Optional[str]:
    """The value of ``--control`` in the rank program's arguments, if any."""
    for i, a in enumerate(cmd):
        if a == "--control" and i + 1 < len(cmd):
            return cmd[i + 1]
        if a.startswith("--control="):
            return a.split("=", 1)[1]
    return None


def parse_tcp(endpoint: str) -> tuple[str, int]:
    m = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:/]+):(\d+)", endpoint.strip())
    if not m:
        raise LaunchError(f"control endpoint {endpoint!r} is not tcp://HOST:PORT")
    return m.group(1).strip("[]"), int(m.group(2))


def public_endpoint(endpoint: str) -> str:
    """What a client should connect to: a wildcard bind address becomes this host's name."""
    host, port = parse_tcp(endpoint)
    if host in ("*", "0.0.0.0", "::"):
        host = socket.getfqdn() or socket.gethostname()
    return f"tcp://{host}:{port}"


def listening_ports() -> set[int]:
    """TCP ports in LISTEN state on this host (from /proc/net/tcp and tcp6)."""
    ports = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(f) as fh:
                next(fh, None)
                for line in fh:
                    parts = line.split()
                    if len(parts) > 3 and parts[3] == "0A":
                        ports.add(int(parts[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the kernel's ephemeral range where the OS can find one: a port from that range
    (what binding port 0 gives) can be taken before the server binds it by any outgoing connection, including
    the client waiting for that very server, whose reconnects can connect its socket to itself (TCP
    self-connect) and leave the server "Address already in use"."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(max(1024, low // 2), low) if low > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _write_atomic(path: str, text: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class EndpointWriter(threading.Thread):
    """Writes the control endpoint to ``path`` once its port listens, while ``proc`` runs."""

    def __init__(self, proc, endpoint: str, path: str, timeout: float):
        super().__init__(daemon=True)
        self.proc, self.endpoint, self.path, self.timeout = proc, endpoint, path, timeout
        self.stop = threading.Event()
        self.written = False

    def run(self):
        _, port = parse_tcp(self.endpoint)
        deadline = time.monotonic() + self.timeout
        while not self.stop.is_set() and self.proc.poll() is None:
            if port in listening_ports():
                _write_atomic(self.path, public_endpoint(self.endpoint) + "\n")
                self.written = True
                print(f"kog launch: control endpoint {public_endpoint(self.endpoint)} "
                      f"written to {self.path}", file=sys.stderr, flush=True)
                return
            if time.monotonic() > deadline:
                print(f"kog launch: control port {port} not listening after {self.timeout:.0f} s; "
                      f"{self.path} not written", file=sys.stderr, flush=True)
                return
            self.stop.wait(0.2)

    def remove(self):
        self.stop.set()
        if self.written:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def run_forwarding(argv: Sequence[str], env: Optional[Mapping[str, str]] = None, *,
                   endpoint_file: Optional[str] = None, endpoint: Optional[str] = None,
                   ready_timeout: float = 900.0, kind: Optional[str] = None) -> int:
    """Run ``argv``, forwarding SIGINT/SIGTERM/SIGHUP to it; its exit code (128+sig if killed).
    Under Open MPI (kind 'openmpi') the first signal goes to the ranks themselves, since mpirun takes
    it as an abort (kccl.mpirun.signal_job); a second one reaches mpirun.

    Outside Slurm the launcher gets its own process group, so a Ctrl-C reaches it once, through
    us. Inside a Slurm job it stays in ours, so that Slurm's process tracking (proctrack/pgid)
    still sees it.
    """
    e = os.environ if env is None else env
    in_slurm = bool(e.get("SLURM_JOB_ID"))
    proc = subprocess.Popen(list(argv), env=None if env is None else dict(env),
                            start_new_session=not in_slurm)
    srun = os.path.basename(argv[0]) == "srun"
    forwarded = []

    def forward(signum, _frame):
        sig = signum
        if srun and signum == signal.SIGINT:
            sig = signal.SIGTERM  # one SIGINT only makes srun print status
        if kind == "openmpi" and not forwarded:
            forwarded.append(sig)
            signal_job(proc.pid, sig, kind)
            return
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass

    old = {}
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            old[s] = signal.signal(s, forward)
        except (ValueError, OSError):  # not the main thread
            pass
    writer = None
    if endpoint_file and endpoint:
        writer = EndpointWriter(proc, endpoint, endpoint_file, ready_timeout)
        writer.start()
    try:
        rc = proc.wait()
    finally:
        if writer is not None:
            writer.remove()
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def parse_args(argv: Sequence[str]):
    argv = list(argv)
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(
        prog="kog launch",
        description="Start N ranks with the launcher present here (MPICH mpiexec, Open MPI "
                    "mpirun, or srun inside a Slurm allocation).",
        epilog="example: kog launch --np 2 -- kog-worker --model DIR --control tcp://127.0.0.1:5555")
    p.add_argument("--np", "-n", type=int, default=None,
                   help="number of ranks, one per GPU (default inside Slurm: SLURM_NTASKS)")
    p.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    p.add_argument("--launcher", default=os.environ.get("KOG_LAUNCHER", "auto"), choices=CHOICES,
                   help="force a launcher; 'mpi': MPICH or Open MPI, never srun (default: auto)")
    p.add_argument("--srun-mpi", default=os.environ.get("KOG_SRUN_MPI", "pmi2"),
                   choices=("pmi2", "pmix", "pmix_v4", "pmix_v5", "pmi", "none"),
                   help="srun --mpi= (default pmi2: what MPICH speaks)")
    p.add_argument("--keep-survivors", action="store_true",
                   help="when a rank dies, leave the others running so that rank 0 can tell its "
                        "clients (a server's ranks; MPICH -disable-auto-cleanup or Open MPI's equivalent)")
    p.add_argument("--launcher-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the launcher (repeatable)")
    p.add_argument("--endpoint-file", metavar="FILE",
                   help="write the rank program's --control endpoint to FILE once it listens "
                        "(removed again when the job ends)")
    p.add_argument("--ready-timeout", type=float, default=900.0, metavar="S",
                   help="give up waiting for the control port after S seconds (default 900)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the rank program and its arguments")
    ns = p.parse_args(argv)
    ns.cmd = list(ns.cmd) + cmd
    if ns.np is None:
        tasks = os.environ.get("SLURM_NTASKS", "")
        if not tasks.isdigit():
            p.error("--np N is required (outside a Slurm allocation)")
        ns.np = int(tasks)
    return ns


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        launcher = detect(prefer=ns.launcher)
        full = build_command(launcher, ns.np, ns.cmd, srun_mpi=ns.srun_mpi,
                             extra=ns.launcher_arg, keep_survivors=ns.keep_survivors)
    except LaunchError as e:
        print(f"kog launch: {e}", file=sys.stderr)
        return 2
    if ns.dry_run:
        print(shlex.join(full), flush=True)
        return 0
    print(f"kog launch ({launcher.kind}): {shlex.join(full)}", file=sys.stderr, flush=True)
    endpoint = control_endpoint(ns.cmd) if ns.endpoint_file else None
    if ns.endpoint_file and not endpoint:
        print("kog launch: --endpoint-file needs --control tcp://HOST:PORT among the rank "
              "program's arguments", file=sys.stderr)
        return 2
    if endpoint:
        try:
            parse_tcp(endpoint)
        except LaunchError as e:
            print(f"kog launch: {e}", file=sys.stderr)
            return 2
    try:
        return run_forwarding(full, endpoint_file=ns.endpoint_file, endpoint=endpoint,
                              ready_timeout=ns.ready_timeout, kind=launcher.kind)
    except OSError as e:
        print(f"kog launch: cannot run {full[0]}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    raise SystemExit(main())
