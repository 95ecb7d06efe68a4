#!/bin/bash
# The README's GPU test command on the GPU machine, as one call: `python3 -m pytest -m gpu` without MPS
# and again with an MPS server running, then the MPI hardening tests under that machine's Open MPI (the
# CPU machine runs them under MPICH). From the repo root, the wheels in .whl
# (../shared/tools/device-wheels.sh gguf==0.19.0 starlette==1.10.0 uvicorn==0.54.0); logs and summary.txt
# under $OUT. STEPS picks steps (default "nomps mps openmpi"); DEADLINE: seconds for all (default 560); PACK=1:
# the logs as $OUT/logs.tgz (the device returns few files).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/kog_gpu_suite} DEADLINE=${DEADLINE:-560}
mkdir -p "$OUT"
. tests/gpu_steps.sh
log "commit ${KOG_COMMIT:-$(git describe --always --dirty 2>/dev/null)}; $(nvidia-smi -L | head -1)"
P="python3 -m pytest -q -ra -p no:cacheprovider --durations=12"
for step in ${STEPS:-nomps mps openmpi}; do case $step in
nomps)   run gpu_nomps 330 $P -m gpu ;;
mps)     nvidia-cuda-mps-control -d && sleep 1
         KOG_TEST_MPS=1 run gpu_mps 300 $P -m gpu
         echo quit | nvidia-cuda-mps-control
         for _ in $(seq 20); do pgrep -f nvidia-cuda-mps-server >/dev/null || pgrep -f nvidia-cuda-mps-control >/dev/null || break; sleep 0.5; done ;;
openmpi) rm -f /dev/shm/vader_segment.* 2>/dev/null; log "mpiexec: $(command -v mpiexec) $(mpiexec --version 2>&1 | head -1)"
         run openmpi 200 $P tests/test_frozen_rank.py tests/test_control_mpi.py tests/test_kccl_fault.py tests/test_mpi_helpers.py tests/test_launch_mpirun.py ;;
*)       log "unknown step $step"; exit 2 ;;
esac; done
ls /dev/shm | head -20 > "$OUT/dev_shm_after.txt"
# PACK=1: the logs in one tarball (the device machine returns only a few files of $OUT), summary.txt beside it
if [ -n "${PACK:-}" ]; then
  t=$(mktemp /tmp/gpu_suite_logs.XXXXXX) && tar czf "$t" -C "$OUT" . && \
    find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv "$t" "$OUT/logs.tgz"
fi
