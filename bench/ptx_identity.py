"""A fingerprint of the monokernel's PTX for a set of builds (nvcc -ptx of build.source() with each build's
defines; nvcc's per-compile internal symbol hashes normalised): a source change that must not change the
kernels (a knob removed, a comment, a refactor) shows the same fingerprints before and after. No GPU needed.

    python3 bench/ptx_identity.py REPO_ROOT > before.txt   (then the same after the change, and diff)
"""
import hashlib, re, os, subprocess, sys, tempfile, json
sys.path.insert(0, sys.argv[1])
os.chdir(sys.argv[1])
from concurrent.futures import ThreadPoolExecutor
from kog_dist.shapes import shape_config
from workers.cuda import build
src = build.source()
cases = [("2b", "BF16", 1, False), ("2b", "BF16", 2, False), ("2b", "BF16", 1, True), ("smollm2-135m", "Q4_1", 1, False),
         ("qwen2.5-0.5b", "BF16", 1, False), ("llama3.2-1b", "Q4_0", 1, False), ("2b", "Q8_0", 1, False), ("2b", "F32", 1, False),
         # one lane in bf16: build.one_lane_units' CFG_PFS 65536, CFG_NR_WO 1, CFG_NR_W2 1; Params through global memory
         ("smollm2-135m", "BF16", 1, False), ("2b", "BF16", 1, False, {"CFG_PCONST": 0}),
         # the speculative builds (verify passes of CFG_SPEC positions; mk_spec*.cuh)
         ("smollm2-135m", "BF16", 1, False, {"CFG_SPEC": 9}), ("smollm2-135m", "Q4_1", 1, False, {"CFG_SPEC": 9}),
         ("llama3.2-1b", "BF16", 1, False, {"CFG_SPEC": 6})]
def one(c):
    name, dt, nr, marks, extra = (c + ({},))[:5]
    cfg = shape_config(name)
    d = build.defines(cfg, dt, 132, extra=extra, nranks=nr, marks=marks)
    with tempfile.TemporaryDirectory() as t:
        f = os.path.join(t, "m.cu"); open(f, "w").write(src)
        r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-ptx", f, "-o", os.path.join(t, "m.ptx")] + [f"-D{k}={v}" for k, v in d.items()], capture_output=True, text=True)
        if r.returncode: return c, "ERROR " + r.stderr[-800:]
        ptx = re.sub(r"_GLOBAL__N__[0-9A-Za-z_]+|tmpxft_[0-9A-Za-z_]+|__nv_static_[0-9A-Za-z_]+|_INTERNAL_[0-9a-f]+_", "SYM", open(os.path.join(t, "m.ptx")).read())
        return c, hashlib.sha256(ptx.encode()).hexdigest()[:16] + (" WARN" if "warning" in r.stderr else "")
with ThreadPoolExecutor(2) as ex:
    for c, h in ex.map(one, cases):
        print(c, h)
