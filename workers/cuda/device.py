"""Facts of the local GPU measured or read through CuPy: the copy bandwidth every benchmark is held
against, and the device's name."""
from __future__ import annotations

import os
import statistics
import sys


def cupy_copy_bandwidth(nbytes: int = 2 ** 31, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth through CuPy (bytes read + written per second)."""
    import cupy as cp
    a = cp.ones(nbytes, dtype=cp.uint8)
    b = cp.empty_like(a)
    for _ in range(2):
        b[...] = a
    times = []
    for _ in range(repeats):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, cp.cuda.get_current_stream().ptr)
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    del a, b
    return 2.0 * nbytes / statistics.median(times)


def device_name(dev_id: int) -> str:
    import cupy as cp
    name = cp.cuda.runtime.getDeviceProperties(dev_id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def probe_main(prog: str, parse, work) -> int:
    """The command of a GPU probe (sm_stream, handoff): parse() checks the arguments and returns what work()
    takes; work(x) runs on the GPU and returns the text to print. A bad argument, no GPU or a CUDA error is
    one line `prog: error: ...` on stderr and exit 1, no traceback."""
    try:
        x = parse()
        import cupy as cp
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
        text = work(x)
    except Exception as e:   # one line, no traceback
        print(f"{prog}: error: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr, flush=True)
        if type(e).__module__.startswith("cupy"):
            os._exit(1)   # a CUDA error is sticky: CuPy's finalizers would print a traceback each
        return 1
    print(text)
    return 0
