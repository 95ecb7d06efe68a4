"""The cost of a speculative verify pass in the monokernel (issue 33): on a one-lane shape with random weights
made on the device, the plain kernel's decode against the speculative build's passes of 1 + F positions, F
forced draft tokens each (the context's last F: mostly rejected, so a pass gives one token and the time a
token is the time a pass). Rounds interleave the sizes; medians. Prints a table and, with --json, the rows.

    python3 bench/spec_verify_cost.py --shape smollm2-135m [--dtype bf16] [--sizes 1,2,4,8] [--reps 3]
                                      [--define CFG_SPEC_NOINL=1] [--profile P]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--sizes", default="1,2,4,8", help="positions a pass (1: the speculative build, no draft)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--define", action="append", default=[], metavar="CFG_X=V",
                    help="extra compile-time define of both builds (variants, e.g. CFG_SPEC_NOINL=1)")
    ap.add_argument("--not-speculating", action="store_true",
                    help="the backend as made without --speculative (its builds' thread count is the plain one's)")
    ap.add_argument("--profile", type=int, default=0, metavar="P",
                    help="instead: the per-phase profile (clock marks) of a plain step and of a pass of P positions")
    a = ap.parse_args()
    import numpy as np
    from workers.factory import STORE_NAMES
    from kog_dist.backend import RunCommand
    from kog_dist.shapes import shape_config
    from workers.cuda.backend import CudaBackend
    from workers.cuda.build import build
    from workers.cuda.weights import random_weights
    cfg, dtype = shape_config(a.shape), STORE_NAMES[a.dtype]
    extra = {k: int(v) for k, v in (d.split("=", 1) for d in a.define)}
    k = build(cfg, dtype, marks=bool(a.profile), extra=extra)
    b = CudaBackend(weights=random_weights(cfg, dtype, k, seed=0), max_seq=a.prompt + a.gen + 16, num_slots=1,
                    timing_marks=bool(a.profile), extra_defines=extra, speculative=not a.not_speculating)
    b._spec()
    if a.profile:
        from workers.cuda.bench_kernel import format_breakdown, phase_breakdown
        prompt = [int(x) for x in np.random.default_rng(1).integers(0, cfg.vocab_size, a.prompt)]
        for label, spec, fixed in (("plain step", 0, None), ("pass of 1", 8, -1), (f"pass of {a.profile}", 8, a.profile - 1)):
            b.run(RunCommand(append=prompt, max_new_tokens=a.gen, speculative=spec), ignore_eos=True,
                  timing_token=a.gen // 8, spec_fixed=fixed)
            print(f"## {a.shape} {dtype}: {label} (step {a.gen // 8})")
            print(format_breakdown(phase_breakdown(b.last_timing, cfg.num_hidden_layers)))
        b.close()
        return 0
    from kog_cli.bench_spec import pass_cost
    rows = pass_cost(b, [int(x) for x in a.sizes.split(",")], a.prompt, a.gen, a.reps)
    b.close()
    if a.json:
        print(json.dumps({"date": time.strftime("%Y-%m-%d"), "shape": a.shape, "dtype": dtype, "rows": rows}))
    else:
        print(f"| {a.shape} {dtype} | positions a pass | us a pass | x plain token |")
        for r in rows:
            print(f"| | {r['positions']} | {r['pass_us']:.1f} | {r['vs_plain']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
