"""N ranks under a real mpiexec compute the one-process function: ids, logits, memory, faults."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kog_dist.checkpoint import Model
from kog_dist.sampling import SamplingParams
from kog_dist.tiny import write_tiny_checkpoint
from kog_dist.backend import RunCommand
from workers.cpu_backend import CpuBackend

from mpi_helpers import REPO_ROOT, mpi_env, run_mpi

pytestmark = pytest.mark.mpi

SHAPE = dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8,
             intermediate_size=128, vocab_size=300, num_lanes=8, sliding_window=6, sliding_window_n_layers=2)
PROMPT = [1, 7, 19, 33, 2, 250, 11]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda d: f"delta{d}")
def model(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(f"d{request.param}"))
    write_tiny_checkpoint(d, broadcast_delay=request.param, seed=request.param, **SHAPE)
    return d


def one_process(d, n=64, sampling=SamplingParams()):
    m = Model(d)
    return CpuBackend(m.cfg, m.weights, m.embed).run(RunCommand(append=PROMPT, max_new_tokens=n, sampling=sampling))


def kog_np(d, n, *extra, timeout=120):
    r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--np", str(n), "--model", d,
                        "--prompt-ids", ",".join(map(str, PROMPT)), "--json", *extra],
                       capture_output=True, text=True, timeout=timeout, env=mpi_env())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("nranks", [1, 2, 4, 8])
def test_greedy_ids_equal_one_process(model, nranks):
    want = one_process(model).token_ids
    out = kog_np(model, nranks, "-n", "64", "--temperature", "0")
    assert out["ranks"] == nranks
    assert out["token_ids"] == want


@pytest.mark.parametrize("nranks", [2, 4])
def test_sampling_same_seed_same_ids(model, nranks):
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=42)
    want = one_process(model, 24, sp).token_ids
    out = kog_np(model, nranks, "-n", "24", "--temperature", "0.8", "--top-k", "50", "--top-p", "0.95",
                 "--seed", "42")
    assert out["token_ids"] == want


RANK_SCRIPT = r"""
import json, sys, numpy as np
from mpi4py import MPI
import kccl
from kog_dist.checkpoint import Model
from kog_dist.engine import ReferenceEngine
from workers.rank import KcclExchange
d, out = sys.argv[1], sys.argv[2]
w = MPI.COMM_WORLD
m0 = Model(d, lanes=range(0, 1))
lanes = m0.cfg.lanes_of_rank(w.rank, w.size)
m = Model(d, lanes=lanes)
comm = kccl.Communicator.create(w, max_floats=1 << 14, depth=m.cfg.broadcast_delay + 2)
eng = ReferenceEngine(m.cfg, m.weights, m.embed, lanes, KcclExchange(comm))
ids = [1, 7, 19, 33, 2, 250, 11]
rows = [eng.forward(np.array(ids), all_logits=True)]
for t in [5, 9, 13, 17]:
    rows.append(eng.step(t)[None])
lane_bytes = sum(a.nbytes for k, a in m.weights.items() if ".attention.w" in k or ".feed_forward." in k)
if w.rank == 0:
    np.save(out, np.concatenate(rows))
print(json.dumps({"rank": w.rank, "lane_bytes": int(lane_bytes)}), flush=True)
comm.close()
"""


@pytest.mark.parametrize("nranks", [2, 4, 8])
def test_logits_agree_and_each_rank_holds_its_share(tmp_path, nranks):
    d = str(tmp_path / "m")
    write_tiny_checkpoint(d, broadcast_delay=2, seed=9, **SHAPE)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    r = run_mpi(nranks, script=str(script), args=[d, str(tmp_path / "logits.npy")], timeout=120)
    assert r.returncode == 0, r.output
    got = np.load(tmp_path / "logits.npy")
    m = Model(d)
    from kog_dist.engine import ReferenceEngine
    eng = ReferenceEngine(m.cfg, m.weights, m.embed)
    want = np.concatenate([eng.forward(np.array(PROMPT), all_logits=True)] + [eng.step(t)[None] for t in [5, 9, 13, 17]])
    rel = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    assert rel.max() < 1e-5, rel
    full = sum(a.nbytes for k, a in m.weights.items() if ".attention.w" in k or ".feed_forward." in k)
    import re
    shares = [(int(a), int(b)) for a, b in re.findall(r'"rank": (\d+), "lane_bytes": (\d+)', r.stdout)]
    assert sorted(rk for rk, _ in shares) == list(range(nranks))
    assert all(nb * nranks == full for _, nb in shares)


def test_ranks_not_dividing_lanes_refused_before_loading(tmp_path):
    d = str(tmp_path / "m")
    write_tiny_checkpoint(d, **SHAPE)
    r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--np", "3", "--model", d],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "3 ranks do not divide num_lanes=8" in r.stderr
    # and the worker itself, started by hand under mpiexec, says the same on every rank
    r = run_mpi(3, code="import sys; from workers.__main__ import main; sys.exit(main(sys.argv[1:]))", args=["--model", d, "--bind", "none", "--backend", "cpu"], timeout=60)
    assert r.returncode != 0 and "do not divide num_lanes=8" in r.stderr
    assert "Traceback" not in r.stderr


def shm_entries():
    return set(glob.glob("/dev/shm/*"))


def test_killed_rank_ends_the_job_cleanly(tmp_path):
    """SIGKILL one rank mid-decode: kog generate --np 4 fails with a clear message within 10 s and
    leaves no process and no shared-memory segment behind."""
    d = str(tmp_path / "m")
    big = dict(SHAPE, hidden_size=256, intermediate_size=1024, num_hidden_layers=6)
    write_tiny_checkpoint(d, **big)
    before = shm_entries()
    p = subprocess.Popen([sys.executable, "-m", "kog_cli", "generate", "--np", "4", "--model", d,
                          "--prompt-ids", "1,2,3", "-n", "100000", "--max-seq", "100000", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(),
                         start_new_session=True)
    victim = None
    deadline = time.time() + 60
    while victim is None and time.time() < deadline:
        time.sleep(0.5)
        ranks = _ranks_of(p.pid)
        if len(ranks) == 4 and all(_past_loading(q) for q in ranks) and _busy(ranks):
            victim = ranks[2]     # decoding: not still importing, which is busy too on a loaded machine
    assert victim, "the ranks never started decoding"
    time.sleep(1.0)
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    try:
        _, err = p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    took = time.time() - t0
    assert p.returncode != 0
    assert took < 10, took
    assert "Traceback" not in err
    assert any(w in err for w in ("exited", "lost", "killed", "died", "terminated")), err
    time.sleep(0.5)
    assert _ranks_of(p.pid) == []
    assert shm_entries() - before == set()



def test_rank_killed_while_starting_leaves_no_mpich_segment(tmp_path):
    """A rank SIGKILLed before it reaches MPI_Init: the others have made MPICH's node segment and wait in
    MPI_Init, so no rank ever drops its name (workers/job.py does once all are past it); kog generate
    sweeps it when the job has ended (kccl.shm.sweep_mpich_segments)."""
    d = str(tmp_path / "m")
    write_tiny_checkpoint(d, **SHAPE)
    before = shm_entries()
    p = subprocess.Popen([sys.executable, "-m", "kog_cli", "generate", "--np", "4", "--model", d,
                          "--prompt-ids", "1,2,3", "-n", "4", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(),
                         start_new_session=True)
    try:
        victim, made = None, set()
        deadline = time.time() + 60
        while not made and time.time() < deadline:
            if victim is None:
                for pid in _ranks_of(p.pid):
                    if _environ(pid).get("PMI_RANK") not in (None, "0"):
                        os.kill(pid, signal.SIGSTOP)      # held before MPI_Init (it is still importing)
                        victim = pid
                        break
            made = {e for e in shm_entries() - before if "/mpich_shm_" in e}
            time.sleep(0.02)
        assert victim and made, "the other ranks never made MPICH's segment"
        time.sleep(0.5)
        assert all(os.path.exists(e) for e in made)      # nobody could drop it: the victim is not in
        os.kill(victim, signal.SIGKILL)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode != 0 and "Traceback" not in err, err
    time.sleep(0.5)
    assert _ranks_of(p.pid) == []
    assert shm_entries() - before == set()


def _past_loading(pid):
    """The rank maps its kccl segments: the communicators exist, the model is loaded next to them."""
    try:
        return "/kccl-" in open(f"/proc/{pid}/maps").read()
    except OSError:
        return False


def _environ(pid):
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)

def _ranks_of(root):
    """pids of the `python -m workers` processes descending from `root`."""
    parent = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                parent[int(pid)] = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out = []
    for pid in parent:
        p, seen = pid, 0
        while p in parent and p != root and seen < 50:
            p, seen = parent[p], seen + 1
        if p != root:
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if len(cmd) > 2 and b"python" in os.path.basename(cmd[0]) and cmd[1:3] == [b"-m", b"workers"]:
            out.append(pid)
    keepers = {parent[q] for q in out}          # under hydra each rank is a keeper's child (workers/keeper.py)
    return sorted(q for q in out if q not in keepers)


def _busy(pids):
    def ticks(pid):
        try:
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            return int(f[11]) + int(f[12])
        except OSError:
            return 0
    a = [ticks(p) for p in pids]
    time.sleep(0.3)
    return all(ticks(p) > t for p, t in zip(pids, a))
