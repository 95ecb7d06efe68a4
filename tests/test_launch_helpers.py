"""Shared helpers of the launch and Slurm tests (no tests here): tiny models, reference ids, ranks."""
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KOG = [sys.executable, "-c", "import sys; from kog_cli.cli import main; sys.exit(main())"]
PROMPT = [1, 5, 9, 42, 7]
NEW_TOKENS = 8


def env(**extra):
    """The environment of a launched job: without a surrounding job's identity (Slurm, PMI, Open MPI's rank
    variables, KOG_*), but with the machine's Open MPI settings (OMPI_MCA_*, OMPI_ALLOW_RUN_AS_ROOT*) unless
    we run inside an Open MPI job: the GPU machine's image has no ssh and sets OMPI_MCA_plm=isolated, without
    which its Open MPI 4.1.6 mpirun looks for ssh and refuses to start (2026-12-02)."""
    in_job = "OMPI_COMM_WORLD_RANK" in os.environ
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPIR_CVAR", "KOG_"))
         or (not in_job and k.startswith(("OMPI_MCA_", "OMPI_ALLOW_RUN_AS_ROOT")))}
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    e["PYTHONUNBUFFERED"] = "1"
    e.update(extra)
    return e


def kog(args, timeout=120, check=True, **kw):
    p = subprocess.run(KOG + list(args), cwd=REPO, env=env(), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                       timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"kog {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def tiny_model(path, lanes=4):
    kog(["checkpoint", "tiny", str(path), "--lanes", str(lanes), "--layers", "2", "--hidden", "64",
         "--heads", "8", "--kv-heads", "4", "--ffn", "128", "--vocab", "256"])
    return str(path)


def reference_ids(model, prompt=PROMPT, n=NEW_TOKENS):
    p = kog(["generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
             "--max-new-tokens", str(n), "--temperature", "0", "--json"])
    return json.loads(p.stdout)["token_ids"]


def client_generate(endpoint, prompt=PROMPT, n=NEW_TOKENS, timeout=60):
    p = kog(["client", "--connect", endpoint, "generate", "--prompt-ids",
             ",".join(map(str, prompt)), "--max-new-tokens", str(n), "--temperature", "0",
             "--json"], timeout=timeout)
    return json.loads(p.stdout)["token_ids"]


def procs_with(marker):
    """{pid: (cmdline, environ)} of live processes whose command line contains ``marker``."""
    out = {}
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            if marker not in cmd:
                continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # a zombie is not running
            with open(f"/proc/{d}/environ", "rb") as f:
                environ = dict(kv.split("=", 1) for kv in
                               f.read().decode(errors="replace").split("\0") if "=" in kv)
        except OSError:
            continue
        out[int(d)] = (cmd, environ)
    return out


def ranks_with(marker):
    """{rank: pid} of the rank processes (kog-worker / python -m workers) for ``marker``."""
    out = {}
    for pid, (cmd, environ) in procs_with(marker).items():
        if "kog-worker" not in cmd and "-m workers" not in cmd:
            continue
        if "mpiexec" in cmd or "srun" in cmd or "launch.cli" in cmd:
            continue
        r = environ.get("PMI_RANK", environ.get("OMPI_COMM_WORLD_RANK", environ.get("SLURM_PROCID")))
        if r is not None:
            out[int(r)] = pid
    return out


def affinity(pid):
    return sorted(os.sched_getaffinity(pid))


def wait_for(pred, timeout, what, poll=0.2):
    t = time.monotonic()
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() - t > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def kill_all(marker):
    """Last resort in a test's cleanup: SIGKILL what this test started (found by its marker)."""
    for pid in procs_with(marker):
        try:
            os.kill(pid, 9)
        except OSError:
            pass
