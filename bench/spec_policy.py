"""The speculative drafting policy of the cuda backend on the agent-like tasks (kog_cli/bench_spec.py's rows,
bf16 storage, k = 8) for several (shortest match, first draft size) pairs in one run, so they can be compared:

    python3 bench/spec_policy.py MODEL MIN_NGRAM:FIRST [MIN_NGRAM:FIRST ...]     e.g. 1:8 2:3 3:3
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import workers.cuda.backend as B  # noqa: E402
from kog_cli.bench_spec import run, table  # noqa: E402

model = sys.argv[1]
for arg in sys.argv[2:]:
    B.SPEC_MIN_NGRAM, B.SPEC_START = (int(x) for x in arg.split(":"))
    rep = run(model, "cuda", 8, 256, 3, 0, say=lambda m: None, dtype="bf16")
    print(f"## shortest match {B.SPEC_MIN_NGRAM}, first draft {B.SPEC_START}")
    print(table(rep), flush=True)
