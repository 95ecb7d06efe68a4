#!/bin/bash
# Issue 52's open question in one device call: the same 4-bit rows alone (bench/q4_rows.py, the monokernel's own
# loops) against inside the monokernel (`kog bench --profile`: each phase's row loop time and GB/s on the path), on
# the llama3.1-8b shape, bf16 / Q4_0 / Q4_K_M, with the variants in VARIANTS (defines, one bench each; "base" is the
# default build). docs/monokernel.md "Quantized rows, 2026-12-07" lists what to try,
# e.g. VARIANTS="base CFG_QUB=16". From the repo root with .whl
# carried; logs under $OUT, the phase tables in $OUT/summary.txt.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/rows_gap}
mkdir -p "$OUT"
echo "commit $(git describe --always --dirty 2>/dev/null); $(nvidia-smi -L | head -1)" | tee "$OUT/summary.txt"
if [ -z "$NOROWS" ]; then   # NOROWS=1: the in-kernel profiles only
  timeout 120 python3 bench/q4_rows.py --shapes 8b.w13,8b.w2 --quick --budget 90 --out "$OUT/q4_rows" > "$OUT/q4_rows.log" 2>&1
  grep -A30 "best of each" "$OUT/q4_rows.log" | tee -a "$OUT/summary.txt"
fi
for v in ${VARIANTS:-base}; do
  d=$([ "$v" = base ] || echo "--define $v")
  tag=$(echo "$v" | tr '=,' '__')
  timeout 200 python3 -m kog_cli bench --shape llama3.1-8b --dtype ${DTYPES:-bf16,q4_0,q4_k_m} --reps 3 --gen 256 \
    --pp 64 --ctx 0 --baselines none --profile --json $d > "$OUT/bench_$tag.json" 2> "$OUT/bench_$tag.log"
  { echo "== $v"; grep -E "tg:|copy bandwidth" "$OUT/bench_$tag.log"
    awk '/phase breakdown of decode step 200/{p=1} p&&/^$/{p=0} p' "$OUT/bench_$tag.log"; } | tee -a "$OUT/summary.txt"
done
