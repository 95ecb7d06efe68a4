"""Which blocks end a phase late, and in which of their steps (issue 30: a phase's tail, the median block's end to
the last block's, is 13-30 us a token of a SmolLM2 WO or W13 phase). The profile build's clock marks of one
decode step (and, with --spec, of the speculative build's pass of one), per phase kind: the blocks that end
last most often and by how much, split into when they entered, how long they waited, staged, ran their rows
and signalled, against the median block of the same phase. --save DIR also writes each step's marks as .npy.

    python3 bench/block_lateness.py --shape smollm2-135m [--dtype bf16] [--step 200] [--spec] [--save DIR]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = ("qkv", "att", "wo", "w13", "w2")


def lateness(t, num_layers: int, top: int = 6) -> str:
    """Per phase kind, over the layers: each block's end minus the median end; the `top` blocks late most on
    average, and for the last block of each phase its steps (entry, wait, stage, rows, signal) minus the
    median block's, averaged over the layers."""
    import numpy as np
    t = t.astype(np.int64)
    out = []
    for k, kind in enumerate(KINDS):
        late_sum = np.zeros(t.shape[1])
        cnt = np.zeros(t.shape[1])
        last_count = np.zeros(t.shape[1], dtype=int)
        parts = []   # last block's (entry, wait, stage, rows, signal) minus the median's
        for i in range(num_layers):
            m = t[5 * i + k]
            ok = (m[:, 2] > 0) & (m[:, 1] > 0)
            if ok.sum() < 2:
                continue
            med = np.median(m[ok, 2])
            late_sum[ok] += (m[ok, 2] - med) / 1e3
            cnt[ok] += 1
            b = int(np.argmax(np.where(ok, m[:, 2], -1)))
            last_count[b] += 1
            if m.shape[1] >= 5 and (m[b, 3] > 0) and (m[b, 4] > 0):
                f = ok & (m[:, 3] > 0) & (m[:, 4] > 0)
                steps = np.stack([m[f, 0], m[f, 1] - m[f, 0], m[f, 3] - m[f, 1], m[f, 4] - m[f, 3], m[f, 2] - m[f, 4]], 1)
                mine = np.array([m[b, 0], m[b, 1] - m[b, 0], m[b, 3] - m[b, 1], m[b, 4] - m[b, 3], m[b, 2] - m[b, 4]])
                parts.append((mine - np.median(steps, 0)) / 1e3)
        mean_late = np.where(cnt > 0, late_sum / np.maximum(cnt, 1), 0)
        order = np.argsort(-mean_late)[:top]
        out.append(f"{kind}: late on average (block: us) " + ", ".join(f"{b}: {mean_late[b]:.2f}" for b in order)
                   + " | last most often " + ", ".join(f"{b} x{last_count[b]}" for b in np.argsort(-last_count)[:top]
                                                        if last_count[b] > 0))
        if parts:
            p = np.mean(parts, 0)
            out.append(f"  the last block against the median, us a layer: entry {p[0]:+.2f}, wait {p[1]:+.2f}, "
                       f"stage {p[2]:+.2f}, rows {p[3]:+.2f}, signal {p[4]:+.2f}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--step", type=int, default=200)
    ap.add_argument("--spec", action="store_true", help="also the speculative build's pass of one (a backend made to speculate)")
    ap.add_argument("--define", action="append", default=[], metavar="CFG_X=V")
    ap.add_argument("--save", default="")
    a = ap.parse_args()
    import numpy as np
    from kog_dist.backend import RunCommand
    from kog_dist.shapes import shape_config
    from workers.factory import STORE_NAMES
    from workers.cuda.backend import CudaBackend
    from workers.cuda.build import build
    from workers.cuda.weights import random_weights
    cfg, dtype = shape_config(a.shape), STORE_NAMES[a.dtype]
    extra = {k: int(v) for k, v in (d.split("=", 1) for d in a.define)}
    k = build(cfg, dtype, marks=True, extra=extra)
    b = CudaBackend(weights=random_weights(cfg, dtype, k, seed=0), max_seq=a.prompt + a.gen + 16, num_slots=1,
                    timing_marks=True, extra_defines=extra, speculative=a.spec)
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, cfg.vocab_size, a.prompt)]
    runs = [("plain step", 0, None)] + ([("pass of 1", 8, -1)] if a.spec else [])
    for label, spec, fixed in runs:
        b.run(RunCommand(append=prompt, max_new_tokens=a.gen, speculative=spec), ignore_eos=True,
              timing_token=a.step, spec_fixed=fixed)
        print(f"## {a.shape} {dtype} {extra or ''}: {label} (step {a.step}, {b.k.nthreads} threads)")
        print(lateness(b.last_timing, cfg.num_hidden_layers))
        if a.save:
            os.makedirs(a.save, exist_ok=True)
            np.save(os.path.join(a.save, f"{a.shape}_{a.dtype}_{label.replace(' ', '_')}.npy"), b.last_timing)
    b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
