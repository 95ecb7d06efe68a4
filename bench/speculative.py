"""Speculative decoding rows (kog_cli/bench_spec.py; `kog bench --model M --speculative K` runs the same):
each agent-like task of kog_cli/agent_tasks.json decoded greedily with and without prompt-lookup speculation,
in the same run on the same backend; tokens/s of both, mean tokens per verify pass, whether the ids are
identical; on the cpu backend the cost of a verify pass of k + 1 = 2, 4, 8 positions relative to one step.

    python3 bench/speculative.py [--model M] [--backend cpu|cuda] [-n 128] [--k 8] [--rounds 1] [--reps 9]
                                 [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kog_cli.bench_spec import run, table  # noqa: E402


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
    report = run(a.model, a.backend, a.k, a.max_new_tokens, a.rounds, a.reps)
    print(json.dumps(report, indent=1) if a.json else table(report))
    return 0 if all(r["identical"] for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
