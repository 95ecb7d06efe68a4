#!/bin/bash
# Issue 55 item 1 on the GPU machine, one call: the token mask inside the monokernel. The CFG_MASK builds compiled in
# parallel first, then bench/grammar_cuda.py (free against constrained tokens/s on the default model, or where its
# 98 MB file is absent its shape's random weights in Q4_1 and bf16 with its tokenizer from $TOK), then the GPU tests
# (tests/test_cuda_grammar.py). From the repo root, carrying .whl (pyzmq gguf starlette uvicorn llguidance jsonschema
# and their dependencies: the command in the commit that added this file) and $TOK (default out/smoltok, written here
# by `python3 bench/grammar_cuda.py --export-tokenizer out/smoltok`). Logs and JSON under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/grammar_cuda}
TOK=${TOK:-out/smoltok}
mkdir -p "$OUT"
echo "commit $(git describe --always --dirty 2>/dev/null); $(nvidia-smi -L | head -1)" | tee "$OUT/summary.txt"
python3 - <<'PY' 2>&1 | tail -2
import sys
sys.path.insert(0, "tests")
from grammar_helpers import ONE_LANE
from kog_dist.shapes import shape_config
from kog_dist.tiny import tiny_config
from workers.cuda.build import one_lane_units, prebuild
from workers.cuda.weights import split_dtype
items = []
for cfg, dt in ((tiny_config(None, **ONE_LANE), "F32"), (tiny_config(None, **ONE_LANE), "BF16"),
                (shape_config("smollm2-135m"), "Q4_1"), (shape_config("smollm2-135m"), "BF16")):
    nt = one_lane_units(cfg, *split_dtype(dt), 132).get("CFG_NT", 512)   # (the backend's: its build's threads)
    items += [(cfg, dt), (cfg, dt, 0, {"CFG_NT": nt, "CFG_MASK": 1})]
prebuild(items)
PY
BENCH="python3 bench/grammar_cuda.py --reps ${REPS:-5}"
[ -n "$(python3 -c 'import sys; sys.path.insert(0, "bench"); import grammar_cuda as g; print(g.default_model() or "")')" ] \
  || BENCH="$BENCH --shape smollm2-135m --tokenizer $TOK"
timeout 120 $BENCH --dtype q4_1 --json-out "$OUT/bench_q4_1.json" > "$OUT/bench_q4_1.log" 2>&1
tail -5 "$OUT/bench_q4_1.log" | tee -a "$OUT/summary.txt"
timeout ${TT:-300} python3 -m pytest -q -ra -s -p no:cacheprovider -m gpu tests/test_cuda_grammar.py > "$OUT/tests.txt" 2>&1
grep -oE "(tiny:|SmolLM2:|F32 seed|BF16 seed).*" "$OUT/tests.txt" | tee -a "$OUT/summary.txt"
tail -15 "$OUT/tests.txt" | tee -a "$OUT/summary.txt"
if [ $SECONDS -lt 500 ]; then   # the device call's 600 s
  timeout $((580 - SECONDS)) $BENCH --dtype bf16 --reps 3 --schemas object6,text --json-out "$OUT/bench_bf16.json" \
    > "$OUT/bench_bf16.log" 2>&1
  tail -4 "$OUT/bench_bf16.log" | tee -a "$OUT/summary.txt"
fi
