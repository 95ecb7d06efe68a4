"""What one grid-wide hand-off costs (handoff.cu): the signal and wait between two phases that a one-lane
model's monokernel takes five times a layer, measured alone, beside other ways to signal and wait.

    python3 -m workers.cuda.handoff                    table: ns a hand-off for each way
    python3 -m workers.cuda.handoff --blocks 132 --json

Every block of a cooperative launch signals, then waits until all blocks have (no work between hand-offs), many
times; block 0 times them with %globaltimer. Baseline: the monokernel's own way (one counter, red.release /
ld.acquire), measured in the same run. With `--outputs N` each block first stores N floats of its own, which
the release orders before the signal (a phase's rows end so). A way that costs less than the baseline is a
candidate for the kernel's signal_lanes / wait_lanes; one that costs the same says the hand-off's price is the
chip's round trip, not the counter.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys

from .device import probe_main


MAX_BLOCKS = 160   # handoff.cu: HO_WPL words a lane of one warp
WAYS = (   # (name, mode, ns): handoff.cu's modes
    ("one counter, acquire polls (monokernel)", 0, 1),
    ("one counter, relaxed polls + fence", 4, 1),
    ("2 counters on own lines", 1, 2),
    ("4 counters on own lines", 1, 4),
    ("8 counters on own lines", 1, 8),
    ("a flag a block, packed words", 2, 0),
    ("a flag a block, own lines", 3, 0),
)


def run(blocks: int | None, threads: int, iters: int, warmup: int, outputs: list[int], repeats: int) -> dict:
    import cupy as cp
    from .device import device_name
    nsm = cp.cuda.Device().attributes["MultiProcessorCount"]
    nb = min(blocks or nsm, nsm)      # one block an SM: all resident (the cooperative launch checks it)
    if nb > MAX_BLOCKS:
        raise ValueError(f"{nb} blocks: handoff.cu's flag waits read at most {MAX_BLOCKS}")
    from kccl.cuda_source import inline_sources
    src = inline_sources([os.path.join(os.path.dirname(os.path.abspath(__file__)), "handoff.cu")])
    f = cp.RawModule(code=src, options=("-std=c++17",)).get_function("handoff")
    words = cp.zeros(nb * 16 + 16, dtype=cp.uint64)
    outs = cp.zeros(max(1, nb * max(outputs)), dtype=cp.float32)
    elapsed = cp.zeros(1, dtype=cp.uint64)
    stream = cp.cuda.get_current_stream()
    rows = []
    for nout in outputs:
        for name, mode, ns in WAYS:
            per = []
            for _ in range(repeats):
                words.fill(0)
                # as the backend launches the monokernel: the driver refuses unless every block is resident,
                # which the waits need (a block not yet running would never signal)
                vals = [ctypes.c_uint64(words.data.ptr), ctypes.c_uint64(outs.data.ptr), ctypes.c_int32(iters),
                        ctypes.c_int32(warmup), ctypes.c_int32(mode), ctypes.c_int32(ns), ctypes.c_int32(nout),
                        ctypes.c_uint64(elapsed.data.ptr)]
                argv = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
                cp.cuda.driver.launchCooperativeKernel(f.kernel.ptr, nb, 1, 1, threads, 1, 1, 0, stream.ptr,
                                                       ctypes.addressof(argv))
                stream.synchronize()
                per.append(int(elapsed.get()[0]) / (iters - warmup))
            rows.append({"way": name, "mode": mode, "counters": ns, "outputs_per_block": nout,
                         "ns_per_handoff": statistics.median(per), "runs_ns": per})
    return {"device": device_name(cp.cuda.Device().id), "sms": nsm, "blocks": nb, "threads": threads,
            "handoffs_timed": iters - warmup, "rows": rows}


def table(r: dict) -> str:
    base = {w["outputs_per_block"]: w["ns_per_handoff"] for w in r["rows"] if w["mode"] == 0}
    out = [f"device: {r['device']}; {r['blocks']} blocks of {r['threads']} threads, {r['handoffs_timed']} hand-offs a "
           f"launch (median of the launches); baseline: the monokernel's one counter, same run",
           "| way                                      | outputs a block | ns a hand-off | vs baseline |",
           "|------------------------------------------|-----------------|---------------|-------------|"]
    for w in r["rows"]:
        b = base.get(w["outputs_per_block"])
        rel = f"{w['ns_per_handoff'] / b:.2f}x" if b else "-"
        out.append(f"| {w['way']:<40} | {w['outputs_per_block']:>15} | {w['ns_per_handoff']:>13.0f} | {rel:>11} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m workers.cuda.handoff", description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=None, help="blocks, one an SM (default: every SM)")
    ap.add_argument("--threads", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3000, help="hand-offs a launch (the first --warmup untimed)")
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--outputs", default="0,2304", help="floats each block stores before it signals, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args(argv)

    def parse():
        outputs = [int(s) for s in a.outputs.split(",") if s.strip()]
        if not outputs or min(outputs) < 0 or a.iters <= a.warmup or a.warmup < 0 or a.threads % 32:
            raise ValueError("--outputs >= 0, --iters > --warmup >= 0, --threads a multiple of 32")
        return outputs

    def work(outputs):
        r = run(a.blocks, a.threads, a.iters, a.warmup, outputs, max(1, a.repeats))
        return json.dumps(r) if a.json else table(r)
    return probe_main("handoff", parse, work)

if __name__ == "__main__":
    sys.exit(main())
