#!/bin/bash
# The same rows on two trees in one device run, interleaved: an older commit and this tree (issue 27: kernel
# source moved, folded and cleaned with byte-identical PTX must also measure the same).
#   git archive OLD | gzip > before.tar.gz; (there) mkdir /tmp/before && tar xzf before.tar.gz -C /tmp/before
#   BEFORE=/tmp/before SITE=/tmp/site bash bench/before_after.sh
# One rank: `kog bench --shape S --baselines none --ctx 0 --pp 64 --reps 3` for each of SHAPES (default: 2b and
# smollm2-135m, bf16). Then NP ranks (default 2): tests/bench_multirank.py 512 (2B shape, bf16, 3 runs) under
# MPIEXEC, under MPS when the GPUs are fewer than the ranks (started here and stopped again). ROUNDS: how many
# times the two trees alternate. SITE: wheels installed with --target (pyzmq), put on each tree's PYTHONPATH.
cd "$(dirname "$0")/.." || exit 1
. bench/common.sh
AFTER=$PWD; ROUNDS=${ROUNDS:-1}; SHAPES=${SHAPES:-"2b smollm2-135m"}; NP=${NP:-2}
MPIEXEC=${MPIEXEC:-"mpirun --allow-run-as-root --oversubscribe -x PYTHONPATH -x PYTHONUNBUFFERED"}
[ -n "$BEFORE" ] && [ -d "$BEFORE/workers/cuda" ] || { echo "before_after.sh: BEFORE=DIR (an older tree) is required" >&2; exit 2; }
header
rc=0
tree_of() { if [ "$1" = before ]; then echo "$BEFORE"; else echo "$AFTER"; fi; }
for ((r = 1; r <= ROUNDS; r++)); do
  for side in before after; do
    t=$(tree_of $side)
    for s in $SHAPES; do
      PYTHONPATH=$t${SITE:+:$SITE} run "r${r}_${side}_$s" $PY -m kog_cli bench --shape "$s" --baselines none --ctx 0 \
        --pp 64 --reps 3 --json-out "$OUT/r${r}_${side}_$s.json" || rc=1
    done
  done
done
if [ "$NP" -gt 1 ]; then
  started=""
  if [ -z "$DRY" ] && [ "${GPUS:-0}" -lt "$NP" ] && ! pgrep -f nvidia-cuda-mps-control >/dev/null; then
    nvidia-cuda-mps-control -d && started=1 && sleep 1
  fi
  for ((r = 1; r <= ROUNDS; r++)); do
    for side in before after; do
      t=$(tree_of $side)
      PYTHONPATH=$t${SITE:+:$SITE} run "r${r}_${side}_np$NP" $MPIEXEC -n "$NP" $PY "$t/tests/bench_multirank.py" 512 || rc=1
    done
  done
  [ -n "$started" ] && echo quit | nvidia-cuda-mps-control
fi
exit $rc
