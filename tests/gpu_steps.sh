# gpu_steps.sh: the step runner shared by the GPU scripts (tests/gpu_multirank.sh, tests/gpu_multigpu.sh,
# kccl/device/run_gpu_checks.sh); sourced, not run. Needs OUT and DEADLINE; STEP_MARGIN (seconds kept
# back from DEADLINE, default 10) and STEP_TAIL (log lines copied into summary.txt, default 25).
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
left() { echo $((DEADLINE - SECONDS - ${STEP_MARGIN:-10})); }
# run NAME SECONDS CMD...: bounded by SECONDS and by what is left of DEADLINE; log in $OUT/NAME.log
run() { local name=$1 t=$2; shift 2; local l; l=$(left)
        if [ "$l" -lt 10 ]; then log "$name skipped: past the ${DEADLINE} s deadline"; return 124; fi
        [ "$t" -gt "$l" ] && t=$l
        local s=$SECONDS; timeout -k 5 "$t" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
        log "$name rc=$rc $((SECONDS - s))s (limit ${t}s)"; tail -n "${STEP_TAIL:-25}" "$OUT/$name.log" >>"$OUT/summary.txt"
        return $rc; }
