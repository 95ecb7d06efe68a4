"""ptxas's resource report of the monokernel for a set of builds (registers, spills, stack) without a GPU:
nvcc -cubin -Xptxas -v of build.source() with each build's defines. A change that adds spills or stack to a
build shows here before a device run.

    python3 bench/kernel_resources.py [SHAPE:DTYPE[:DEFINE=V,...] ...]   (default: the bench shapes in bf16 and q4)
"""
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kog_dist.shapes import shape_config  # noqa: E402
from workers.cuda import build  # noqa: E402

DEFAULT = ["2b:BF16", "smollm2-135m:BF16", "smollm2-135m:Q4_1", "llama3.2-1b:BF16", "llama3.2-1b:Q4_0", "qwen2.5-0.5b:BF16"]


def one(spec: str) -> str:
    name, dt, *rest = spec.split(":")
    extra = dict(kv.split("=") for kv in rest[0].split(",")) if rest else {}
    d = build.defines(shape_config(name), dt, 132, extra={k: int(v) for k, v in extra.items()})
    with tempfile.TemporaryDirectory() as t:
        f = os.path.join(t, "m.cu")
        open(f, "w").write(build.source())
        r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", f, "-o",
                            os.path.join(t, "m.cubin")] + [f"-D{k}={v}" for k, v in d.items()],
                           capture_output=True, text=True)
    if r.returncode:
        return f"{spec}: ERROR {r.stderr[-600:]}"
    text = r.stderr
    m = re.search(r"Compiling entry function 'monokernel'.*?Used (\d+) registers", text, re.S)
    sp = re.search(r"Function properties for monokernel\s+(\d+) bytes stack frame, (\d+) bytes spill stores, "
                   r"(\d+) bytes spill loads", text)
    return (f"{spec}: {m.group(1) if m else '?'} registers; stack {sp.group(1)} B, spill stores {sp.group(2)} B, "
            f"spill loads {sp.group(3)} B" if sp else f"{spec}: {text[-400:]}")


if __name__ == "__main__":
    with ThreadPoolExecutor(2) as ex:
        for line in ex.map(one, sys.argv[1:] or DEFAULT):
            print(line, flush=True)
