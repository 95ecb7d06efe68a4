"""The project's Slurm batch scripts on a real one-node Slurm cluster (launch/slurm/ci-cluster.sh
start brings one up; CI does it in .ci/run). Skipped with the reason when no cluster answers."""
import json
import os
import re
import shutil
import subprocess
import time

import pytest

from test_launch_helpers import (REPO, client_generate, env, kill_all, procs_with, ranks_with,
                                 reference_ids, tiny_model, wait_for)

SERVE = os.path.join(REPO, "launch", "slurm", "serve.sbatch")
BENCH = os.path.join(REPO, "launch", "slurm", "bench.sbatch")


def _cluster_problem():
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "Slurm is not installed (sinfo/sbatch not on PATH): run launch/slurm/ci-cluster.sh start"
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%t"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: slurmctld is not answering"
    if p.returncode != 0:
        return f"no Slurm cluster answers (sinfo: {p.stderr.strip()[:200]}): run launch/slurm/ci-cluster.sh start"
    states = {s.strip().rstrip("*~#") for s in p.stdout.split()}
    if not states & {"idle", "mix"}:
        return f"no idle Slurm node (sinfo states: {sorted(states) or 'none'})"
    return None


_PROBLEM = _cluster_problem()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(_PROBLEM is not None, reason=str(_PROBLEM))]


def sbatch(args, cwd, script_args=(), **extra):
    p = subprocess.run(["sbatch", "--parsable", "--chdir", str(cwd)] + list(args)
                       + list(script_args), cwd=str(cwd), env=env(**extra),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    job = p.stdout.strip().split(";")[0]
    # with --wait, sbatch's status is the job's; the job id on stdout says it was submitted
    assert job.isdigit(), f"sbatch failed ({p.returncode}): {p.stderr}"
    return job


def job_state(job):
    p = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, text=True, timeout=15)
    return p.stdout.strip() if p.returncode == 0 else ""


def job_info(job):
    p = subprocess.run(["scontrol", "-o", "show", "job", job], stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, text=True, timeout=15)
    return dict(kv.split("=", 1) for kv in p.stdout.split() if "=" in kv)


def wait_gone(job, timeout):
    wait_for(lambda: job_state(job) in ("", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"),
             timeout, f"job {job} to end", poll=0.5)


def cancel(job):
    subprocess.run(["scancel", job], timeout=15, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = tiny_model(tmp_path_factory.mktemp("slurm") / "tiny4", lanes=4)
    return m, reference_ids(m)


def serve_job(tmp_path, model_dir):
    """serve.sbatch on 2 tasks (cpu backend) until its control endpoint is up: (job, endpoint file, output)."""
    ep = tmp_path / "endpoint"
    job = sbatch(["--ntasks=2", "--overcommit", "--time=10", f"--output={tmp_path}/serve-%j.out"],
                 tmp_path, [SERVE, "--model", model_dir, "--backend", "cpu", "--max-seq", "256",
                            "--endpoint-file", str(ep)])
    out = tmp_path / f"serve-{job}.out"

    def up():
        if ep.exists():
            return True
        if job_state(job) in ("", "COMPLETED", "FAILED", "CANCELLED"):
            raise AssertionError(f"job {job} ended before serving:\n"
                                 + (out.read_text() if out.exists() else "(no output)"))
    try:
        wait_for(up, 150, f"job {job}'s control endpoint", poll=0.5)
    except BaseException:
        cancel(job)
        kill_all(model_dir)
        raise
    return job, ep, out


def test_serve_sbatch_decodes_and_scancel_stops_every_rank(tmp_path, model):
    model_dir, ref = model
    job, ep, out = serve_job(tmp_path, model_dir)
    try:
        endpoint = ep.read_text().strip()
        assert endpoint.startswith("tcp://127.0.0.1:")
        ranks = ranks_with(model_dir)
        assert sorted(ranks) == [0, 1], ranks
        # ranks started by srun --mpi=pmi2, and their layout came from MPI
        assert client_generate(endpoint) == ref

        cancel(job)
        wait_gone(job, 60)
        text = out.read_text()
        assert "kog-serve: all 2 ranks exited 0 after SIGTERM" in text, text
        wait_for(lambda: not procs_with(model_dir), 15, "every rank gone")
        assert not ep.exists(), "endpoint file left behind"
        info = job_info(job)
        if info:   # still known to slurmctld (MinJobAge): the batch script's own status
            assert info.get("ExitCode", "0:0").split(":")[0] == "0", info
    finally:
        cancel(job)
        kill_all(model_dir)


def test_serve_sbatch_splits_a_one_lane_model_by_tensor_parallelism(tmp_path):
    """A one-lane model (the shape of every Llama-family checkpoint) over 2 Slurm tasks: heads, FFN columns
    and vocabulary split (docs/tensor-parallel.md), the one-process ids through the control plane."""
    one = tiny_model(tmp_path / "tiny1", lanes=1)
    ref = reference_ids(one)
    job, ep, out = serve_job(tmp_path, one)
    try:
        assert sorted(ranks_with(one)) == [0, 1]
        assert client_generate(ep.read_text().strip()) == ref
        cancel(job)
        wait_gone(job, 60)
        assert "tensor parallel" in out.read_text()
    finally:
        cancel(job)
        kill_all(one)


def test_serve_sbatch_ranks_not_dividing_lanes_fail_fast(tmp_path, model):
    model_dir, _ = model
    t0 = time.monotonic()
    job = sbatch(["--ntasks=3", "--overcommit", "--time=5", f"--output={tmp_path}/bad-%j.out"],
                 tmp_path, [SERVE, "--model", model_dir, "--backend", "cpu"])
    try:
        wait_gone(job, 90)
        assert time.monotonic() - t0 < 90
        text = (tmp_path / f"bad-{job}.out").read_text()
        assert "3 ranks do not divide num_lanes=4" in text, text
        assert "kog-serve: ranks exited with status" in text, text
        info = job_info(job)
        if info:
            assert info.get("JobState") == "FAILED", info
    finally:
        cancel(job)
        kill_all(model_dir)


# What `kog bench --json` prints (the shape kog_cli.bench.table formats), for a stand-in `kog`.
FAKE_REPORT = {
    "date": "2026-01-01", "device": "stand-in", "sms": 1, "model": "tiny", "dtype": "F32",
    "copy_bandwidth_GBps": 100.0,
    "monokernel": {"streamed_bytes_per_token": 1e6,
                   "pp": {"prompt": 16, "tokens_per_s": 1000.0, "ttft_ms": 16.0},
                   "tg": {"prompt": 8, "gen": 8, "tokens_per_s": 50.0, "ms_per_token": 20.0,
                          "GB_per_s": 0.05, "fraction_of_copy_bw": 0.0005}},
    "baselines": []}


def test_bench_sbatch_leaves_table_and_json(tmp_path):
    # The batch job's mechanics, with a stand-in `kog` (kog bench itself needs a CUDA GPU): it runs
    # `kog bench ARGS --json` once and leaves bench.json, the table made from it, and env.txt.
    fake = tmp_path / "bin" / "kog"
    fake.parent.mkdir()
    (tmp_path / "report.json").write_text(json.dumps(FAKE_REPORT))
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path}/kog-args.txt\n"
                    f"echo '[bench] measuring' >&2\ncat {tmp_path}/report.json\n")
    fake.chmod(0o755)
    e = env()
    job = sbatch(["--ntasks=1", "--time=5", "--wait", f"--output={tmp_path}/bench-%j.out"],
                 tmp_path, [BENCH, "--model", "/m", "--reps", "2"],
                 PATH=f"{fake.parent}{os.pathsep}{e['PATH']}")
    text = (tmp_path / f"bench-{job}.out").read_text()
    assert "kog-bench: done" in text, text
    assert (tmp_path / "kog-args.txt").read_text().split() == \
        ["bench", "--model", "/m", "--reps", "2", "--json"]
    outdir = tmp_path / f"kog-bench-{job}"
    assert json.loads((outdir / "bench.json").read_text()) == FAKE_REPORT
    table = (outdir / "bench.txt").read_text()
    assert "| backend" in table and "tg8 @ 8" in table and "50.0" in table, table
    assert "tg8 @ 8" in text                      # the table is in the job output too
    assert "command:" in (outdir / "env.txt").read_text()


def test_bench_sbatch_runs_the_real_kog_bench(tmp_path, model):
    model_dir, _ = model
    job = sbatch(["--ntasks=1", "--time=10", "--wait", f"--output={tmp_path}/bench-%j.out"],
                 tmp_path, [BENCH, "--model", model_dir, "--reps", "1", "--pp", "16", "--prompt",
                            "8", "--gen", "8", "--ctx", "0", "--baselines", "none"])
    text = (tmp_path / f"bench-{job}.out").read_text()
    outdir = tmp_path / f"kog-bench-{job}"
    # Without a GPU, kog bench measures the cpu backend (auto); with one, the monokernel.
    assert "kog-bench: done" in text, text
    assert json.loads((outdir / "bench.json").read_text())["monokernel"]["tg"]["tokens_per_s"] > 0
    assert "tg8 @ 8" in (outdir / "bench.txt").read_text()


def test_kog_launch_inside_an_allocation_uses_srun_pmi2(tmp_path):
    # A batch job that runs `kog launch` itself: srun --mpi=pmi2 starts mpi4py ranks of the
    # mpich wheel, and their layout comes from MPI.
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nexec python3 -m launch.cli --np 3 -- python3 -m launch.discovery\n")
    job = sbatch(["--ntasks=3", "--overcommit", "--time=5", "--wait",
                  f"--output={tmp_path}/launch-%j.out"], tmp_path, [str(script)])
    text = (tmp_path / f"launch-{job}.out").read_text()
    assert "kog launch (srun): " in text and "--mpi=pmi2 -n 3" in text, text
    rows = sorted((json.loads(m) for m in re.findall(r"\{[^{}]*\}", text)), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["local_rank"], r["local_size"], r["source"]) for r in rows] == \
        [(i, 3, i, 3, "mpi") for i in range(3)], text
