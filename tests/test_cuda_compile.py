"""CI without a GPU: every CUDA source of the cuda backend compiles with nvcc for sm_90 (skips where nvcc
is not on PATH). The GPU behaviour is in tests/test_cuda_backend.py (marker gpu)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest

CUDA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workers", "cuda")
SOURCES = sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu")))


def test_sources_exist():
    names = {os.path.basename(s) for s in SOURCES}
    assert {"monokernel.cu", "prefill.cu"} <= names


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("src", SOURCES, ids=os.path.basename)
@pytest.mark.parametrize("wt", [0, 1, 2], ids=["fp32", "bf16", "fp16"])
def test_nvcc_compiles(src, wt, tmp_path):
    out = tmp_path / "x.o"
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", f"-DCFG_WT={wt}", "-c", src, "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def test_inlined_source_has_no_includes():
    from workers.cuda.build import source
    s = source()
    assert '#include "' not in s and "monokernel" in s and "pf_attn" in s
