"""`kog bench --model M --speculative K`: the speculative-decoding rows. Each agent-like task of
agent_tasks.json (edits of code given in the prompt, a rename, a reformatting, and a free-text control) is
decoded greedily with and without prompt-lookup speculation (up to K draft tokens a verify pass), in the same
run on the same backend, alternated --reps times: tokens/s of both (medians), mean tokens a verify pass gives,
and whether the ids are identical (they must be: the exit status says). On the cpu backend also the cost of
one verify pass of k + 1 = 2, 4, 8 positions relative to one fast decode step, at the position after the
first task's prompt (medians of rounds that interleave the sizes, so a load that comes and goes falls on all
of them alike). bench/speculative.py runs the same with its own flags.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from kog_dist.backend import RunCommand
from kog_dist.formats import open_model
from kog_dist.models import model_id, resolve_model
from kog_dist.tokenizer import load_tokenizer
from workers.cpu_verify import supports as fast_verify_supports
from workers.cpu_verify import verify_rows
from workers.factory import make_backend, resolve
from workers.oneshot import end_of_turn_ids

TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_tasks.json")
SIZES = (2, 4, 8)


def load_tasks(path: str = TASKS) -> list[dict]:
    with open(path) as f:
        return json.load(f)["tasks"]


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


def pass_cost(backend, sizes, prompt_len: int, gen: int, reps: int, seed: int = 1) -> list[dict]:
    """The cuda backend's verify passes of P positions against its plain token: rows {"positions", "pass_us",
    "vs_plain"} (medians of `reps` rounds that interleave the sizes). Every pass of P > 1 drafts P - 1 tokens,
    the context's last (CudaBackend.run's spec_fixed): mostly rejected, so a pass gives about one token; P = 1
    is the speculative build's pass without a draft. A random prompt of prompt_len tokens, gen tokens."""
    import numpy as np
    sizes = [s for s in sizes if 1 <= s <= backend.spec_max]
    prompt = [int(x) for x in np.random.default_rng(seed).integers(0, backend.cfg.vocab_size, prompt_len)]
    times = {"plain": [], **{s: [] for s in sizes}}
    for _ in range(reps):
        for key in times:
            cmd = RunCommand(append=prompt, max_new_tokens=gen, speculative=0 if key == "plain" else 8)
            fixed = None if key == "plain" else (-1 if key == 1 else key - 1)
            r = backend.run(cmd, ignore_eos=True, spec_fixed=fixed)
            passes = gen if key in ("plain", 1) else r.spec_steps + 1
            times[key].append(r.decode_ms / max(1, passes - 1))
    one = statistics.median(times["plain"])
    rows = [{"positions": "plain", "pass_us": one * 1e3, "vs_plain": 1.0}]
    rows += [{"positions": s, "pass_us": statistics.median(times[s]) * 1e3, "vs_plain": statistics.median(times[s]) / one}
             for s in sizes]
    return rows


def task_row(backend, cfg, tok, task: dict, k: int, new_tokens: int, rounds: int) -> dict:
    ids = tok.encode_chat([{"role": "user", "content": task["prompt"]}])
    runs, cpu = {0: [], k: [], "prefill": []}, {0: [], k: [], "prefill": []}
    for _ in range(rounds):
        for key in runs:
            n = 1 if key == "prefill" else new_tokens
            cmd = RunCommand(slot=0, append=ids, max_new_tokens=n, speculative=0 if key == "prefill" else key,
                             stop_ids=end_of_turn_ids(cfg, tok))
            backend.free(0)
            c0 = time.process_time()
            runs[key].append(backend.run(cmd))
            cpu[key].append(time.process_time() - c0)
    runs.pop("prefill")
    plain, spec = runs[0][0], runs[k][0]
    tps = {key: statistics.median(r.decode_tokens_per_s for r in rs) for key, rs in runs.items()}
    # this process's CPU seconds past the prefill's: what the decode cost when other processes take turns
    # on the cores (wall-clock tokens/s then measure the others as much as the decode)
    pre = statistics.median(cpu["prefill"])
    cps = {key: (len(plain.token_ids) - 1) / max(1e-9, statistics.median(cpu[key]) - pre) for key in runs}
    return {"task": task["name"], "kind": task["kind"], "prompt_tokens": len(ids),
            "new_tokens": len(plain.token_ids), "plain_tokens_per_s": tps[0], "spec_tokens_per_s": tps[k],
            "speedup": tps[k] / tps[0] if tps[0] else 0.0,
            "plain_tokens_per_cpu_s": cps[0], "spec_tokens_per_cpu_s": cps[k], "cpu_speedup": cps[k] / cps[0],
            # tokens a verify pass gives: its accepted drafts plus the token it draws itself
            "tokens_per_step": (spec.spec_accepted + spec.spec_steps) / max(1, spec.spec_steps),
            # tokens a pass of the weights over the whole decode (after the first token), passes without a
            # draft included: what the speedup follows when every pass costs the same
            "tokens_per_pass_all": (len(spec.token_ids) - 1) / max(1, len(spec.token_ids) - 1 - spec.spec_accepted),
            "spec_steps": spec.spec_steps, "drafted": spec.spec_drafted, "accepted": spec.spec_accepted,
            "plain_token_ids": list(plain.token_ids),
            "identical": all(r.token_ids == plain.token_ids for rs in runs.values() for r in rs)}


def plain_default_rows(kind, src, cfg, tok, tasks, rows, spec_defs, new_tokens, rounds, dtype, say) -> None:
    """A backend made to speculate may compile other defines than its plain build's best (another thread
    count: workers.cuda.build.speculating_defines): then each task's plain decode on a backend made without
    speculation too, and the speedup against the faster plain (rows gain plain_default_tokens_per_s)."""
    backend, _ = make_backend(kind, src, num_slots=1, dtype=dtype)
    try:
        if backend.k.defines == spec_defs:
            return
        diff = {k: v for k, v in spec_defs.items() if backend.k.defines.get(k) != v}
        say(f"[spec] plain decode on a backend not made to speculate (the speculating one's builds differ: {diff})")
        for t, row in zip(tasks, rows):
            ids = tok.encode_chat([{"role": "user", "content": t["prompt"]}])
            got = []
            for _ in range(rounds):
                backend.free(0)
                got.append(backend.run(RunCommand(slot=0, append=ids, max_new_tokens=new_tokens,
                                                  stop_ids=end_of_turn_ids(cfg, tok))))
            row["plain_default_tokens_per_s"] = statistics.median(r.decode_tokens_per_s for r in got)
            # the same ids unless a near tie rounds otherwise at another thread count (reported, not required)
            row["plain_default_identical"] = all(list(r.token_ids) == row["plain_token_ids"] for r in got)
            best = max(row["plain_tokens_per_s"], row["plain_default_tokens_per_s"])
            row["speedup_vs_best_plain"] = row["spec_tokens_per_s"] / best if best else 0.0
    finally:
        backend.close()


def run(model: str | None, backend_kind: str, k: int, new_tokens: int, rounds: int, cost_reps: int,
        say=lambda m: print(m, file=sys.stderr, flush=True), tasks: list[dict] | None = None,
        dtype: str | None = None) -> dict:
    """dtype: the storage (bf16, q4_1, ...; None: the model's own)."""
    src = open_model(resolve_model(model))
    tok = load_tokenizer(src)
    kind = resolve(backend_kind)
    backend, cfg = make_backend(kind, src, num_slots=2, dtype=dtype, speculative=True)
    tasks = tasks if tasks is not None else load_tasks()
    rows = []
    try:
        for t in tasks:
            row = task_row(backend, cfg, tok, t, k, new_tokens, rounds)
            rows.append(row)
            say(f"[spec] {t['name']}: {row['plain_tokens_per_s']:.1f} -> {row['spec_tokens_per_s']:.1f} tok/s, "
                f"{row['tokens_per_step']:.2f} tokens a pass, identical {row['identical']}")
        first = tok.encode_chat([{"role": "user", "content": tasks[0]["prompt"]}])
        cost = verify_cost(backend, first, cost_reps) if cost_reps > 0 else None
        spec_defs = getattr(getattr(backend, "k", None), "defines", None)
    finally:
        backend.close()
    if spec_defs is not None:
        plain_default_rows(kind, src, cfg, tok, tasks, rows, spec_defs, new_tokens, rounds, dtype, say)
    return {"date": time.strftime("%Y-%m-%d"), "backend": kind,
            "model": model_id(src.path) if getattr(src, "path", None) else src.name, "dtype": dtype, "k": k,
            "max_new_tokens": new_tokens, "rounds": rounds, "rows": rows, "verify_cost": cost,
            "speculating": any(r["spec_steps"] for r in rows)}


def table(report: dict) -> str:
    out = [f"model: {report['model']}  storage: {report.get('dtype') or 'its own'}  backend: {report['backend']}  k: {report['k']}  "
           f"{report['max_new_tokens']} tokens a task, medians of {report['rounds']}",
           "| task | kind | new tokens | plain tok/s | speculative tok/s | speedup | CPU-time speedup | "
           "tokens/drafting pass | tokens/pass | accepted/drafted | identical |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        per_pass = f"{r['tokens_per_step']:.2f}" if r["spec_steps"] else "- (no pass)"
        out.append(f"| {r['task']} | {r['kind']} | {r['new_tokens']} | {r['plain_tokens_per_s']:.1f} | "
                   f"{r['spec_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['cpu_speedup']:.2f}x | {per_pass} | "
                   f"{r['tokens_per_pass_all']:.2f} | "
                   f"{r['accepted']}/{r['drafted']} | {r['identical']} |")
    if any("plain_default_tokens_per_s" in r for r in report["rows"]):
        out.append("plain decode on a backend not made to speculate (its own defines): " + ", ".join(
            f"{r['task']} {r['plain_default_tokens_per_s']:.1f} tok/s (ids the same: {r['plain_default_identical']}), "
            f"speculative {r['speedup_vs_best_plain']:.2f}x the faster plain" for r in report["rows"] if "plain_default_tokens_per_s" in r))
    if not report.get("speculating"):
        out.append(f"(the {report['backend']} backend made no verify pass: speculation is not in it yet)")
    cost = report.get("verify_cost")
    if cost:
        out.append(f"verify pass cost relative to one step ({cost['step_ms']:.1f} ms): " +
                   ", ".join(f"k + 1 = {T}: {cost[str(T)]:.2f}x" for T in SIZES))
    return "\n".join(out)
