"""Speculative decoding rows: each agent-like task of bench/agent_tasks.json decoded greedily with and
without prompt-lookup speculation, in the same run on the same backend; tokens/s of both, mean tokens
per verify pass, and whether the ids are identical (they must be). On the cpu backend, also the cost
of one verify pass of k + 1 = 2, 4, 8 positions relative to one fast decode step, at the position
after the first task's prompt (medians of --reps rounds that interleave the sizes, so a load that
comes and goes falls on all of them alike).

    python3 bench/speculative.py [--model M] [--backend cpu|cuda] [-n 128] [--k 8] [--rounds 1] [--reps 9]
                                 [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from kog_dist.backend import RunCommand
from kog_dist.formats import open_model
from kog_dist.models import resolve_model
from kog_dist.tokenizer import load_tokenizer
from workers.cpu_verify import supports as fast_verify_supports
from workers.cpu_verify import verify_rows
from workers.factory import make_backend, resolve
from workers.oneshot import end_of_turn_ids

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = (2, 4, 8)


def verify_cost(backend, ids, reps: int, slot: int = 1) -> dict | None:
    """{"step_ms": one fast step, "T": verify pass of T positions / one step} on a cpu backend whose
    decoder has the fast verify pass; None on other backends."""
    d = getattr(backend, "decoder", None)
    if not fast_verify_supports(d):
        return None
    backend.free(slot)
    backend.run(RunCommand(slot=slot, append=ids, max_new_tokens=0))
    eng = backend.slots[slot]
    p, toks = eng.pos, [int(t) for t in ids[-max(SIZES):]]
    times = {T: [] for T in (1,) + SIZES}
    for _ in range(reps):
        for T in times:
            t0 = time.perf_counter()
            if T == 1:
                d.step(eng, toks[0])
            else:
                verify_rows(d, eng, toks[:T])
            times[T].append(time.perf_counter() - t0)
            eng.truncate(p)
    backend.free(slot)
    one = statistics.median(times[1])
    return {"step_ms": one * 1e3, **{str(T): statistics.median(times[T]) / one for T in SIZES}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1,
                    help="plain and speculative runs of each task, alternated; tokens/s are the medians")
    ap.add_argument("--reps", type=int, default=9, help="rounds of the verify-cost timing (0: skip it)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.reps < 0 or a.max_new_tokens < 1 or not 1 <= a.k <= 8:
        ap.error("--rounds and -n take 1 or more, --reps 0 or more, --k 1 to 8")
    src = open_model(resolve_model(a.model))
    tok = load_tokenizer(src)
    kind = resolve(a.backend)
    backend, cfg = make_backend(kind, src, num_slots=2)
    tasks = json.load(open(os.path.join(HERE, "agent_tasks.json")))["tasks"]
    rows = []
    for t in tasks:
        ids = tok.encode_chat([{"role": "user", "content": t["prompt"]}])
        runs, cpu = {0: [], a.k: [], "prefill": []}, {0: [], a.k: [], "prefill": []}
        for _ in range(a.rounds):
            for k in runs:
                n = 1 if k == "prefill" else a.max_new_tokens
                cmd = RunCommand(slot=0, append=ids, max_new_tokens=n, speculative=0 if k == "prefill" else k,
                                 stop_ids=end_of_turn_ids(cfg, tok))
                backend.free(0)
                c0 = time.process_time()
                runs[k].append(backend.run(cmd))
                cpu[k].append(time.process_time() - c0)
        runs.pop("prefill")
        plain, spec = runs[0][0], runs[a.k][0]
        tps = {k: statistics.median(r.decode_tokens_per_s for r in rs) for k, rs in runs.items()}
        # this process's CPU seconds past the prefill's: what the decode cost when other processes
        # take turns on the cores (wall-clock tokens/s then measure the others as much as the decode)
        pre = statistics.median(cpu["prefill"])
        cps = {k: (len(plain.token_ids) - 1) / max(1e-9, statistics.median(cpu[k]) - pre) for k in runs}
        row = {"task": t["name"], "kind": t["kind"], "prompt_tokens": len(ids), "new_tokens": len(plain.token_ids),
               "plain_tokens_per_s": tps[0], "spec_tokens_per_s": tps[a.k],
               "speedup": tps[a.k] / tps[0] if tps[0] else 0.0,
               "plain_tokens_per_cpu_s": cps[0], "spec_tokens_per_cpu_s": cps[a.k], "cpu_speedup": cps[a.k] / cps[0],
               # tokens a verify pass gives: its accepted drafts plus the token it draws itself
               "tokens_per_step": (spec.spec_accepted + spec.spec_steps) / max(1, spec.spec_steps),
               "spec_steps": spec.spec_steps, "drafted": spec.spec_drafted, "accepted": spec.spec_accepted,
               "identical": all(r.token_ids == plain.token_ids for rs in runs.values() for r in rs)}
        rows.append(row)
        print(f"[spec] {t['name']}: {row['plain_tokens_per_s']:.1f} -> {row['spec_tokens_per_s']:.1f} tok/s, "
              f"identical {row['identical']}", file=sys.stderr, flush=True)
    first = tok.encode_chat([{"role": "user", "content": tasks[0]["prompt"]}])
    cost = verify_cost(backend, first, a.reps) if a.reps > 0 else None
    backend.close()
    report = {"date": time.strftime("%Y-%m-%d"), "backend": kind, "model": src.name, "k": a.k,
              "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "rows": rows, "verify_cost": cost}
    if a.json:
        print(json.dumps(report, indent=1))
        return 0
    print("| task | kind | new tokens | plain tok/s | speculative tok/s | speedup | CPU-time speedup | "
          "tokens/pass | accepted/drafted | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['kind']} | {r['new_tokens']} | {r['plain_tokens_per_s']:.1f} | "
              f"{r['spec_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['cpu_speedup']:.2f}x | "
              f"{r['tokens_per_step']:.2f} | {r['accepted']}/{r['drafted']} | {r['identical']} |")
    if cost:
        print(f"\nverify pass cost relative to one step ({cost['step_ms']:.1f} ms): " +
              ", ".join(f"k + 1 = {T}: {cost[str(T)]:.2f}x" for T in SIZES))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
