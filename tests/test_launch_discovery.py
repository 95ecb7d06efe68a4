"""launch.discovery: rank layout from MPI (real mpiexec), env fallbacks, GPU per local rank."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from launch import discovery
from launch.discovery import from_env, gpu_for_local_rank, physical_gpu, visible_devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "MPIR_CVAR"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _rows(text):
    # Ranks share one pipe: their lines can run together, so pick the JSON objects out.
    return [json.loads(m) for m in re.findall(r"\{[^{}]*\}", text)]


def _mpiexec(n, args, timeout=60, **extra):
    return subprocess.run([MPIEXEC, "-n", str(n)] + args, cwd=REPO, env=_env(**extra),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


# ---------------------------------------------------------------- from MPI itself

@needs_mpiexec
@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 3])
def test_discover_under_mpiexec(n):
    p = _mpiexec(n, [sys.executable, "-m", "launch.discovery"])
    assert p.returncode == 0, p.stderr
    rows = sorted(_rows(p.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(n))
    for r in rows:
        assert r["size"] == n and r["local_size"] == n and r["local_rank"] == r["rank"]
        assert r["source"] == "mpi" and r["hostname"]


@needs_mpiexec
@pytest.mark.mpi
def test_layout_comes_from_mpi_not_from_variables():
    # Lying launcher variables must not win over MPI's own answer.
    p = _mpiexec(2, [sys.executable, "-m", "launch.discovery"],
                 SLURM_PROCID="7", SLURM_LOCALID="5", OMPI_COMM_WORLD_RANK="9")
    assert p.returncode == 0, p.stderr
    rows = _rows(p.stdout)
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert sorted(r["local_rank"] for r in rows) == [0, 1]


@needs_mpiexec
@pytest.mark.mpi
def test_job_spanning_nodes_is_refused_on_every_rank():
    # MPICH can split one host into fake "nodes" (cliques): COMM_TYPE_SHARED then sees 2 nodes.
    p = _mpiexec(4, [sys.executable, "-m", "launch.discovery"], timeout=60, MPIR_CVAR_NUM_CLIQUES="2")
    assert p.returncode != 0
    assert "span 2 nodes" in p.stderr and "one node" in p.stderr, p.stderr
    assert p.stderr.count("kog: the 4 ranks of this job span 2 nodes") == 4  # every rank, no hang
    assert "ranks 0,2" in p.stderr and "ranks 1,3" in p.stderr


# ---------------------------------------------------------------- fallbacks

def test_env_fallback_slurm():
    i = from_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3"})
    assert (i.rank, i.size, i.local_rank, i.source) == (3, 4, 3, "slurm")


def test_env_fallback_openmpi_wins_over_pmi():
    i = from_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                  "PMI_RANK": "0", "PMI_SIZE": "8"})
    assert (i.rank, i.size, i.local_rank, i.local_size, i.source) == (1, 2, 1, 2, "ompi")


def test_env_fallback_pmi_hydra():
    i = from_env({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"})
    assert (i.rank, i.size, i.local_rank, i.local_size, i.source) == (2, 4, 2, 4, "pmi")


def test_env_fallback_nothing_is_a_single_rank():
    i = from_env({})
    assert (i.rank, i.size, i.local_rank, i.local_size, i.source) == (0, 1, 0, 1, "none")


def test_single_node_check_without_mpi_uses_variables(monkeypatch):
    monkeypatch.setattr(discovery, "_mpi", lambda: None)
    for k in list(os.environ):
        if k.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    with pytest.raises(discovery.MultiNodeError, match="one node"):
        discovery.require_single_node()


# ---------------------------------------------------------------- GPUs

def test_gpu_without_mask_is_local_rank():
    assert [gpu_for_local_rank(i, env={}) for i in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="has 2"):
        gpu_for_local_rank(2, num_devices=2, env={})


def test_gpu_with_mask():
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert visible_devices(env) == ["4", "5", "6", "7"]
    assert gpu_for_local_rank(2, env=env) == 2          # ordinal as the process sees devices
    assert physical_gpu(2, env=env) == "6"
    with pytest.raises(ValueError, match="shows only 4"):
        gpu_for_local_rank(4, env=env)


def test_gpu_one_visible_device_per_task():
    env = {"CUDA_VISIBLE_DEVICES": "GPU-1234abcd"}   # Slurm --gpus-per-task, UUID form
    assert gpu_for_local_rank(3, env=env) == 0
    assert physical_gpu(3, env=env) == "GPU-1234abcd"


def test_gpu_hidden():
    with pytest.raises(ValueError, match="hides every GPU"):
        gpu_for_local_rank(0, env={"CUDA_VISIBLE_DEVICES": ""})
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,1,-1,3"}) == ["0", "1"]
