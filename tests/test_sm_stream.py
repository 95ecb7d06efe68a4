"""The SM streaming probe (workers/cuda/sm_stream.py): a clean one-line refusal without a GPU, the table's
format, and on the GPU machine (`pytest -m gpu tests/test_sm_stream.py`) a small run whose variants agree."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workers.cuda import sm_stream

try:
    import cupy
    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:
    HAVE_GPU = False


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is present: the refusal path is not taken")
def test_without_a_gpu_one_line_error_and_exit_1():
    r = subprocess.run([sys.executable, "-m", "workers.cuda.sm_stream", "--sms", "8"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sm_stream: error:"), r.stderr


def test_bad_sms_list_is_a_one_line_error(capsys):
    assert sm_stream.main(["--sms", "8,x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sm_stream: error:" in err[0]


def test_table_lists_every_row_with_the_fraction_of_copy_bandwidth():
    r = {"device": "X", "sms": 132, "copy_bandwidth_GBps": 4000.0, "rows": [
        {"variant": "registers, 6 loads a row", "sms": 64, "GB_per_s": 3950.0, "GB_per_s_per_sm": 61.7,
         "fraction_of_copy_bw": 0.9875},
        {"variant": "bulk ring 2 x 6 KB a warp", "sms": 32, "GB_per_s": 1990.0, "GB_per_s_per_sm": 62.2,
         "fraction_of_copy_bw": 0.4975}]}
    t = sm_stream.table(r).splitlines()
    assert "4000 GB/s" in t[0] and "baseline" in t[0]
    assert t[3].split("|")[2].strip() == "64" and t[3].split("|")[5].strip() == "98.8%"
    assert t[4].split("|")[3].strip() == "1990" and len(t) == 5


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
def test_small_run_on_the_gpu():
    r = subprocess.run([sys.executable, "-m", "workers.cuda.sm_stream", "--sms", "4,8", "--mb", "0.5", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["copy_bandwidth_GBps"] > 100
    assert {(w["kernel"], w["sms"]) for w in out["rows"]} >= {("reg6", 4), ("tma2x6k", 8)}
    for w in out["rows"]:   # a few SMs cannot exceed the copy bandwidth, and each streams something
        assert 0 < w["fraction_of_copy_bw"] < 1.2 and w["GB_per_s_per_sm"] > 1


def test_shared_memory_covers_the_kernels_layout():
    # sm_stream.cu: x (12 KB), mbarriers (8 bytes a slot), ring aligned up to 128 bytes, WARPS * slots * size
    for _, kern, slots, size in sm_stream.VARIANTS:
        need = 3072 * 4 + (16 * slots * 8 + 127 + 16 * slots * size if slots else size)
        assert sm_stream.smem_bytes(slots, size) >= need
        assert sm_stream.smem_bytes(slots, size) <= 227 * 1024, kern
