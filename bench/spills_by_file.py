"""Where the monokernel's machine code and its local-memory traffic (ptxas spills) sit, by source file, without
a GPU: nvcc -cubin -lineinfo of build.source() with a build's defines, `nvdisasm -g`, then every SASS instruction
of the `monokernel` function counted under the kernel source file (mk_*.cuh) its line falls in, with its LDL
(spill loads) and STL (spill stores). Two builds side by side show where one build's extra spills are, e.g. the
plain phases inside the speculative build (docs/monokernel.md, "One lane, 2026-12-04").

    python3 bench/spills_by_file.py SHAPE:DTYPE[:DEFINE=V,...] [...]
    e.g. smollm2-135m:BF16 smollm2-135m:BF16:CFG_SPEC=9 smollm2-135m:BF16:CFG_SPEC=9,CFG_NT=384

nvdisasm: on PATH or $NVDISASM (`pip download --no-deps nvidia-cuda-nvdisasm`, unzip: nvidia/cu13/bin).
"""
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def attribute(files: list, sass: str, function: str = "monokernel") -> dict:
    """{file: [instructions, LDL, STL]} of `function` in `sass` (nvdisasm -g text), by the source file of the
    line each instruction belongs to (files[n - 1]: line n's file, kccl.cuda_source.inlined_line_files)."""
    out = collections.defaultdict(lambda: [0, 0, 0])
    section, line = None, 0
    for l in sass.split("\n"):
        m = re.match(r"\s*\.section\s+\.text\.(\w+)", l)
        if m:
            section = m.group(1)
            continue
        m = re.search(r"//## File .*line (\d+)", l)
        if m:
            line = int(m.group(1))
            continue
        if section != function or not re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", l):
            continue
        c = out[files[line - 1] if 0 < line <= len(files) else "?"]
        c[0] += 1
        c[1] += bool(re.search(r"\bLDL(\.\w+)*\b", l))
        c[2] += bool(re.search(r"\bSTL(\.\w+)*\b", l))
    return dict(out)


def build_sass(spec: str, nvdisasm: str) -> tuple[str, str]:
    from kccl.cuda_source import inlined_line_files
    from kog_dist.shapes import shape_config
    from workers.cuda import build
    name, dt, *rest = spec.split(":")
    extra = {k: int(v) for k, v in (kv.split("=") for kv in rest[0].split(","))} if rest else {}
    d = build.defines(shape_config(name), dt, 132, extra=extra)
    src = build.source()
    files = inlined_line_files([os.path.join(build.HERE, f) for f in build.SOURCES])
    with tempfile.TemporaryDirectory() as t:
        f, cub = os.path.join(t, "m.cu"), os.path.join(t, "m.cubin")
        open(f, "w").write(src)
        subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-lineinfo", f, "-o", cub]
                       + [f"-D{k}={v}" for k, v in d.items()], check=True, capture_output=True)
        return files, subprocess.run([nvdisasm, "-g", "-c", cub], check=True, capture_output=True, text=True).stdout


if __name__ == "__main__":
    tool = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not tool or len(sys.argv) < 2:
        sys.exit("usage: python3 bench/spills_by_file.py SHAPE:DTYPE[:DEFINE=V,...] ... (nvdisasm on PATH or $NVDISASM)")
    for spec in sys.argv[1:]:
        counts = attribute(*build_sass(spec, tool))
        tot = [sum(c[k] for c in counts.values()) for k in range(3)]
        print(f"{spec}: {tot[0]} instructions, LDL {tot[1]}, STL {tot[2]}")
        for f, (n, ld, st) in sorted(counts.items(), key=lambda kv: -kv[1][0]):
            print(f"  {f:20s} {n:7d}  LDL {ld:5d}  STL {st:5d}")
