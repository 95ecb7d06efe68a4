"""How fast a given number of SMs streams weights, by register loads and by copy-engine rings (sm_stream.cu).

    python3 -m workers.cuda.sm_stream                  table: GB/s for 32, 64, 96 and all SMs
    python3 -m workers.cuda.sm_stream --sms 16,64 --json

Each active SM runs one block that streams its own MB megabytes of bf16 W13 units and dots them with a vector,
as the monokernel's row loops do; the copy bandwidth is measured in the same run. Every variant's outputs
must equal the register kernel's bit for bit (same per-lane summation order), or the probe fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from .device import probe_main

UNIT_BYTES = 12288          # a W13 unit: two bf16 rows of 3072
X_BYTES = 3072 * 4
WARPS = 16
VARIANTS = (                # (name, kernel, slots a warp, slot bytes or idle shared memory)
    ("registers, 6 loads a row", "reg6", 0, 0),
    ("registers, 12 loads a row", "reg12", 0, 0),
    ("registers + 150 KB idle smem", "reg6", 0, 150 * 1024),
    ("bulk ring 2 x 6 KB a warp", "tma2x6k", 2, 6144),
    ("bulk ring 3 x 4 KB a warp", "tma3x4k", 3, 4096),
    ("bulk ring 4 x 3 KB a warp", "tma4x3k", 4, 3072),
    ("bulk ring 6 x 2 KB a warp", "tma6x2k", 6, 2048),
)


def smem_bytes(slots: int, size: int) -> int:
    """sm_stream.cu's layout: x, then (rings) one mbarrier a slot and 128-byte aligned slots."""
    if not slots:
        return X_BYTES + size
    return X_BYTES + WARPS * slots * 8 + 127 + WARPS * slots * size


def run(sms: list[int], mb: float, repeats: int) -> dict:
    import cupy as cp
    from .device import cupy_copy_bandwidth, device_name
    nsm = cp.cuda.Device().attributes["MultiProcessorCount"]
    sms = sorted({min(max(1, s), nsm) for s in sms})
    upb = max(16, int(mb * 2 ** 20) // UNIT_BYTES)
    print(f"[sm_stream] {nsm} SMs; {upb} units of 12 KB ({upb * UNIT_BYTES / 2 ** 20:.1f} MB) a block", file=sys.stderr)
    src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm_stream.cu")).read()
    mod = cp.RawModule(code=src, options=("-std=c++17",))
    cp.random.seed(0)
    n_el = nsm * upb * UNIT_BYTES // 2
    W = (cp.random.randint(0x3c00, 0x3fff, size=n_el, dtype=cp.int32)
         | (cp.random.randint(0, 2, size=n_el, dtype=cp.int32) << 15)).astype(cp.uint16)   # +-(0.008..2)
    x = cp.random.standard_normal(3072, dtype=cp.float32) * 0.01
    out = cp.zeros(nsm * upb, dtype=cp.float32)
    bw = cupy_copy_bandwidth()
    rows, ref = [], {}
    for name, kern, slots, size in VARIANTS:
        f = mod.get_function(kern)
        smem = smem_bytes(slots, size)
        f.max_dynamic_shared_size_bytes = smem
        for n in sms:
            times = []
            for _ in range(repeats + 1):
                out.fill(0)
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record()
                f((n,), (512,), (W, out, x, np.int32(upb), np.int32(2)), shared_mem=smem)
                e1.record()
                e1.synchronize()
                times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
            got = cp.asnumpy(out[: n * upb])
            if n not in ref:
                ref[n] = got
            elif not np.array_equal(got, ref[n]):
                raise RuntimeError(f"{kern} on {n} SMs: outputs differ from the register kernel's")
            gbs = 2 * n * upb * UNIT_BYTES / min(times[1:]) / 1e9
            rows.append({"variant": name, "kernel": kern, "smem_bytes": smem, "sms": n, "GB_per_s": gbs,
                         "GB_per_s_per_sm": gbs / n, "fraction_of_copy_bw": gbs * 1e9 / bw})
    return {"device": device_name(cp.cuda.Device().id), "sms": nsm, "copy_bandwidth_GBps": bw / 1e9,
            "mb_per_block": upb * UNIT_BYTES / 2 ** 20, "rows": rows}


def table(r: dict) -> str:
    out = [f"device: {r['device']} ({r['sms']} SMs); copy bandwidth (measured now): {r['copy_bandwidth_GBps']:.0f} GB/s; "
           f"baseline: the register kernel (the monokernel's way)",
           "| variant                      | SMs | GB/s | GB/s per SM | of copy BW |",
           "|------------------------------|-----|------|-------------|------------|"]
    for w in r["rows"]:
        out.append(f"| {w['variant']:<28} | {w['sms']:>3} | {w['GB_per_s']:>4.0f} | {w['GB_per_s_per_sm']:>11.1f} | "
                   f"{100 * w['fraction_of_copy_bw']:>9.1f}% |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m workers.cuda.sm_stream", description=__doc__.splitlines()[0])
    ap.add_argument("--sms", default="32,64,96,1000", help="active SMs, comma-separated (clipped to the device's)")
    ap.add_argument("--mb", type=float, default=4.0, help="megabytes each block streams per pass (2 passes)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args(argv)

    def work(sms):
        r = run(sms, a.mb, max(1, a.repeats))
        return json.dumps(r) if a.json else table(r)
    return probe_main("sm_stream", lambda: [int(s) for s in a.sms.split(",") if s.strip()], work)


if __name__ == "__main__":
    sys.exit(main())
