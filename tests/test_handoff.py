"""The hand-off probe (workers/cuda/handoff.py): a clean one-line refusal without a GPU, the table's format and
its baseline, and on the GPU machine (`pytest -m gpu tests/test_handoff.py`) a small run of every way."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workers.cuda import handoff

try:
    import cupy
    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:
    HAVE_GPU = False


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is present: the refusal path is not taken")
def test_without_a_gpu_one_line_error_and_exit_1():
    r = subprocess.run([sys.executable, "-m", "workers.cuda.handoff"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("handoff: error:"), r.stderr


@pytest.mark.parametrize("args", [["--outputs", "0,x"], ["--outputs", "-1"], ["--iters", "10", "--warmup", "10"],
                                  ["--threads", "100"]])
def test_bad_arguments_are_a_one_line_error(args, capsys):
    assert handoff.main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "handoff: error:" in err[0]


def test_table_compares_each_way_with_the_baseline_of_its_output_size():
    r = {"device": "X", "blocks": 132, "threads": 512, "handoffs_timed": 100, "rows": [
        {"way": "one counter, acquire polls (monokernel)", "mode": 0, "counters": 1, "outputs_per_block": 0,
         "ns_per_handoff": 800.0},
        {"way": "a flag a block, packed words", "mode": 2, "counters": 0, "outputs_per_block": 0,
         "ns_per_handoff": 600.0},
        {"way": "one counter, acquire polls (monokernel)", "mode": 0, "counters": 1, "outputs_per_block": 2304,
         "ns_per_handoff": 1000.0},
        {"way": "a flag a block, packed words", "mode": 2, "counters": 0, "outputs_per_block": 2304,
         "ns_per_handoff": 1100.0}]}
    t = handoff.table(r).splitlines()
    assert "132 blocks of 512 threads" in t[0] and "baseline" in t[0]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in t[3:]]
    assert [c[2] for c in cells] == ["800", "600", "1000", "1100"]
    assert [c[3] for c in cells] == ["1.00x", "0.75x", "1.00x", "1.10x"]


def test_every_way_is_a_mode_of_the_kernel():
    src = open(handoff.__file__.replace(".py", ".cu")).read()
    modes = {m for _, m, _ in handoff.WAYS}
    assert modes == {0, 1, 2, 3, 4}
    for m in modes:
        assert f"mode == {m}" in src or (m == 3 and "mode == 2 ? 1 : 16" in src)
    assert all(ns >= 1 for _, m, ns in handoff.WAYS if m == 1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
def test_small_run_on_the_gpu():
    r = subprocess.run([sys.executable, "-m", "workers.cuda.handoff", "--iters", "400", "--warmup", "50",
                        "--repeats", "2", "--outputs", "0,512", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["rows"]) == 2 * len(handoff.WAYS)
    for w in out["rows"]:   # a grid-wide round trip: more than an L2 hit, far less than a launch's 0.1 ms
        assert 100 < w["ns_per_handoff"] < 100_000, w
