#!/bin/bash
# Interleaved A/B rows of monokernel variants (compile-time defines), as the session logs ran them: on one
# lease, the base build and each variant alternate ROUNDS times, so drift of the device hits all alike.
#   bash bench/ab_variants.sh "CFG_MARKS=0" "CFG_MARKS=0 CFG_PCONST=1"      # one rank, 2B shape
#   NP=2 ROUNDS=2 bash bench/ab_variants.sh "CFG_SKEW_NS=45000"            # two ranks, one GPU each
# Each argument is one variant (space-separated defines). One rank: `kog bench --shape 2b --baselines none
# --ctx 0 --pp 64 --reps 5 [--define ...]` (CTX=N: --ctx N); NP=2: `--np 2 --pp 64 --reps 3` with the 4096-context row.
# Every run's JSON lands in $OUT; the last line of each log is its decode row.
cd "$(dirname "$0")/.." || exit 1
. bench/common.sh
SHAPE=${SHAPE:-2b}; ROUNDS=${ROUNDS:-2}; NP=${NP:-1}; CTX=${CTX:-0}   # CTX=4096: the long-context row too
DT=(${DTYPE:+--dtype "$DTYPE"})   # DTYPE=bf16,q4_1: those rows in each run
if [ "$NP" -gt 1 ]; then
  base=($PY -m kog_cli bench --shape "$SHAPE" --np "$NP" --baselines none --pp 64 --reps ${REPS:-3})
else
  base=($PY -m kog_cli bench --shape "$SHAPE" "${DT[@]}" --baselines none --ctx "$CTX" --pp 64 --reps ${REPS:-5})
fi
header
rc=0
for ((r = 1; r <= ROUNDS; r++)); do
  run "r${r}_base" "${base[@]}" --json-out "$OUT/r${r}_base.json" || rc=1
  v=0
  for variant in "$@"; do
    v=$((v + 1)); defs=()
    for d in $variant; do defs+=(--define "$d"); done
    run "r${r}_v${v}" "${base[@]}" "${defs[@]}" --json-out "$OUT/r${r}_v${v}.json" || rc=1
  done
done
exit $rc
