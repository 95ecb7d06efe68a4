"""This machine: `kog topo --json` tells the truth, and a bound rank really runs where planned."""
import json
import os
import re
import subprocess
import sys

from topology import plan, probe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI_VARS = re.compile(r"^(OMPI_|PMI_|MPI_LOCAL|SLURM_|PMIX_)")


def clean_env():
    return {k: v for k, v in os.environ.items() if not MPI_VARS.match(k)}


def run_py(code, **kw):
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=clean_env(), **kw)


def sys_cpus():
    with open("/sys/devices/system/cpu/online") as f:
        text = f.read().strip()
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def pci_gpus():
    """Count GPUs independently of the probe: NVIDIA/AMD display or accelerator PCI functions."""
    n = 0
    base = "/sys/bus/pci/devices"
    for d in os.listdir(base):
        v = open(os.path.join(base, d, "vendor")).read().strip()
        c = int(open(os.path.join(base, d, "class")).read(), 16)
        if v in ("0x10de", "0x1002") and (c >> 16 == 0x03 or c >> 8 == 0x1200):
            n += 1
    return n


def test_kog_topo_json_is_truthful():
    r = subprocess.run([sys.executable, "-m", "topology.cli", "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    m = doc["machine"]
    assert m["cpu_count"] == len(sys_cpus()) == os.cpu_count()
    nodes = [d for d in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", d)]
    assert len(m["numa_nodes"]) == len(nodes)
    assert len(m["gpus"]) >= pci_gpus()          # AMD partitions may add logical GPUs
    if pci_gpus() == 0:
        assert m["gpus"] == [] and doc["links"]["matrix"] == []
        assert all(e["gpu"] is None for e in doc["plan"]["ranks"])
    for g in m["gpus"]:
        assert g["numa"] is None or g["numa"] >= 0
    planned = [c for e in doc["plan"]["ranks"] for c in e["cores"]]
    assert set(planned) <= set(sys_cpus())


def test_plan_does_not_depend_on_own_affinity():
    """Ranks already pinned by mpirun must still agree on one plan."""
    code = ("import os, json, topology\n"
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "p = topology.plan(topology.probe(), 2)\n"
            "print(json.dumps([e.cores for e in p.entries]))\n")
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [e.cores for e in plan(probe(), 2).entries]


BIND = """
import json, os, threading, topology
ev, done = threading.Event(), threading.Event()
t = threading.Thread(target=lambda: (ev.set(), done.wait()))
t.start(); ev.wait()                      # a thread that exists before binding
out = topology.place_rank({rank}, {nranks}, mode={mode!r})
aff = sorted(os.sched_getaffinity(0))
taff = sorted(os.sched_getaffinity(t.native_id))
done.set(); t.join()
print(json.dumps({{"out": out, "aff": aff, "thread": taff}}))
"""


def bind_in_subprocess(rank, nranks, mode):
    r = run_py(BIND.format(rank=rank, nranks=nranks, mode=mode))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def expected_cores(rank, nranks):
    p = plan(probe(), nranks)
    allowed = os.sched_getaffinity(0)
    return sorted(set(p.entries[rank].cores) & allowed) or sorted(allowed), p.entries[rank]


def ranks_for_test():
    """Two to four ranks (at most one per GPU where there are GPUs)."""
    n = max(2, min(4, os.cpu_count()))
    gpus = len(probe().gpus)
    return min(n, gpus) if gpus else n


def test_rank_bound_to_planned_cores():
    nranks = ranks_for_test()
    for rank in (0, nranks - 1):
        want, entry = expected_cores(rank, nranks)
        got = bind_in_subprocess(rank, nranks, "cores")
        assert got["out"]["error"] is None
        assert got["aff"] == want and got["thread"] == want
        assert got["out"]["numa"] == entry.numa and got["out"]["gpu"] == entry.gpu
        assert len(want) < os.cpu_count() or os.cpu_count() == 1


def test_numa_and_none_modes():
    m = probe()
    n = ranks_for_test()
    allowed = os.sched_getaffinity(0)
    got = bind_in_subprocess(0, n, "numa")
    entry = plan(m, n).entries[0]
    node = m.node(entry.numa)
    assert got["aff"] == sorted(set(node.cpus) & allowed)
    assert got["out"]["mempolicy"].startswith(("preferred node", "skipped"))
    got = bind_in_subprocess(n - 1, n, "none")
    assert got["aff"] == sorted(allowed) and got["out"]["mempolicy"] == "unchanged"


def test_local_rank_from_launcher_environment():
    env = clean_env()
    n = ranks_for_test()
    env.update({"OMPI_COMM_WORLD_LOCAL_RANK": str(n - 1), "OMPI_COMM_WORLD_LOCAL_SIZE": str(n)})
    code = ("import json, os, topology\n"
            "out = topology.place_rank(5, 8, mode='cores')\n"
            "print(json.dumps([out, sorted(os.sched_getaffinity(0))]))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env=env)
    out, aff = json.loads(r.stdout)
    assert (out["rank"], out["local_rank"], out["local_size"]) == (5, n - 1, n)
    assert aff == expected_cores(n - 1, n)[0]
