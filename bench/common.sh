# Sourced by the bench/ scripts: where results go, what is recorded beside them, and DRY=1 (print the
# commands instead of running them; tests/test_bench_scripts.py checks them that way on a CPU machine).
OUT=${OUT:-/tmp/kog_bench_out}
mkdir -p "$OUT"
PY=${PY:-$(command -v python3)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# the commit the rows belong to: `git describe` where .git travelled, else KOG_COMMIT set by hand
export KOG_COMMIT=${KOG_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}

run() {   # run NAME CMD...: the command's output into $OUT/NAME.log, its line into $OUT/commands.txt
  local name=$1; shift
  echo "$*" >>"$OUT/commands.txt"
  if [ -n "${DRY:-}" ]; then echo "$*"; return 0; fi
  echo "[$(date -u +%H:%M:%S)] $name: $*" >&2
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$(date -u +%H:%M:%S)] $name: exit $rc" >&2
  tail -n 25 "$OUT/$name.log"
  return $rc
}

header() {
  [ -n "${DRY:-}" ] && return 0
  { date -u; echo "commit $KOG_COMMIT"; nvidia-smi -L 2>/dev/null; } | tee "$OUT/machine.txt"
}
