"""The cuda backend's drafting policy replayed offline on the agent-like tasks (kog_cli/agent_tasks.json), to
choose the policy without a GPU: the greedy ids of every task (cpu backend, bf16 storage, the default model
unless --model), then the device's speculative loop pass by pass (mk_spec_lm.cuh: AdaptiveDraft's sizes,
kog_dist.speculative.lookup's draft of n = 4 down to the shortest match, a pass of one without a match),
each pass costed by its positions from a measured table (bench/spec_verify_cost.py), against the plain
decode's one token a pass. Also two bounds: the best any choice of draft sizes could do with the latest match
of each length ("oracle"), and with any earlier match ("any match"), at the measured costs and at passes that
cost one token whatever their positions ("flat"). On 2026-12-04 the replay's speedups were within 0.1x of the
device's for 24 of the 25 (task, policy) pairs measured (2:4 reformat: 2.74x against 2.33x; BENCHMARKS.md
"Speculative verify passes").

    python3 bench/spec_replay.py [--model M] [--policy MIN_NGRAM:FIRST ...] [--cost 1.03,1.35,...]
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kog_dist.speculative import AdaptiveDraft, lookup  # noqa: E402

# a pass of P = 1..9 positions in plain tokens: SmolLM2-135M bf16, one H200, 2026-12-03/04 (P = 3, 5, 7
# interpolated: the row loops run P = 3 as 4 and 5..9 as 9, attention and norms scale with P)
COST = (1.03, 1.35, 1.55, 1.64, 2.0, 2.30, 2.45, 2.60, 2.70)


def greedy_ids(model, tasks, new_tokens):
    from kog_dist.backend import RunCommand
    from kog_dist.formats import open_model
    from kog_dist.models import resolve_model
    from kog_dist.tokenizer import load_tokenizer
    from workers.factory import make_backend
    from workers.oneshot import end_of_turn_ids
    src = open_model(resolve_model(model))
    tok = load_tokenizer(src)
    b, cfg = make_backend("cpu", src, num_slots=1, dtype="bf16")
    out = {}
    try:
        for t in tasks:
            ids = tok.encode_chat([{"role": "user", "content": t["prompt"]}])
            b.free(0)
            r = b.run(RunCommand(slot=0, append=ids, max_new_tokens=new_tokens, stop_ids=end_of_turn_ids(cfg, tok)))
            out[t["name"]] = ([int(x) for x in ids], [int(x) for x in r.token_ids])
    finally:
        b.close()
    return out


def replay(prompt, gen, cost, min_ngram, first, max_new, k=8):
    """(speedup over plain decode, passes that checked a draft, drafts accepted, draft tokens)."""
    policy = AdaptiveDraft(k, start=first)
    m, total, steps, drafted, accepted, draft = 1, 0.0, 0, 0, 0, []
    while m < len(gen):                      # a pass feeds gen[m - 1] and the draft
        acc = 0
        while acc < len(draft) and m + acc < len(gen) and draft[acc] == gen[m + acc]:
            acc += 1
        total += cost[len(draft)]
        if draft:
            steps, drafted, accepted = steps + 1, drafted + len(draft), accepted + acc
        policy.update(len(draft), acc)
        m += acc + 1
        draft = []
        if m < len(gen):
            size = min(policy.size(), max_new - m - 1)   # the device knows max_tokens, not where EOS falls
            if size > 0:
                draft = lookup(prompt + gen[:m], size, 4, min_ngram)
    return (len(gen) - 1) / total, steps, accepted, drafted


def bound(prompt, gen, cost, any_match):
    """The cheapest cover of gen by passes whose drafts are prompt lookups (dynamic programming)."""
    best = [0.0] * (len(gen) + 1)
    for m in range(len(gen) - 1, 0, -1):
        ctx = prompt + gen[:m]
        drafts = []
        for n in (1, 2, 3, 4):
            ends = [e for e in range(n - 1, len(ctx) - 1) if ctx[e - n + 1:e + 1] == ctx[len(ctx) - n:]]
            drafts += [ctx[e + 1:e + 9] for e in (ends if any_match else ends[-1:])]
        good = 0
        for d in drafts:
            acc = 0
            while acc < len(d) and m + acc < len(gen) and d[acc] == gen[m + acc]:
                acc += 1
            good = max(good, acc)
        best[m] = min(cost[nd] + best[min(len(gen), m + nd + 1)] for nd in range(good + 1))
    return (len(gen) - 1) / best[1]


def main() -> int:
    from kog_cli.bench_spec import load_tasks
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--policy", nargs="*", default=["3:3", "3:4", "4:4", "2:4", "3:8"])
    ap.add_argument("--cost", default=",".join(map(str, COST)), help="a pass of 1..9 positions, in plain tokens")
    a = ap.parse_args()
    cost = [float(x) for x in a.cost.split(",")]
    tasks = load_tasks()
    ids = greedy_ids(a.model, tasks, a.gen)
    names = [t["name"] for t in tasks]
    print("| drafting (shortest match : first draft) | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for pol in a.policy:
        mn, first = (int(x) for x in pol.split(":"))
        cells = [replay(*ids[n], cost, mn, first, a.gen) for n in names]
        print(f"| replay {pol} | " + " | ".join(f"{s:.2f}x, {(acc + n) / max(1, n):.2f}" for s, n, acc, _ in cells) + " |")
    flat = [1.0] * len(cost)
    for any_match, c in itertools.product((False, True), (cost, flat)):
        label = ("any match" if any_match else "oracle") + (", flat" if c is flat else "")
        print(f"| {label} | " + " | ".join(f"{bound(*ids[n], c, any_match):.2f}x" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
