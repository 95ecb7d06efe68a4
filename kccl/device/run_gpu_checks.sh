#!/bin/bash
# GPU checks of the kccl cuda_ipc transport on one machine (one H200 shared by N ranks under MPS):
# compile, smoke (N = 2), gpu (host ops N = 2, 4; stress and LL stress N = 2, 4), stress8 (stress and
# LL stress N = 8, 3000 rounds each, bounded at 100 s together), bench (N = 1, 2, 4; its "kernel LL"
# rows are the LL all-reduce), faults (a silent rank, a SIGKILLed rank). About 2 min on the
# H200; logs and summary.txt under ${OUT:-/tmp/kccl_out}. Run from the repository root as root (MPS
# control). STEPS="compile stress8" runs a subset; without the mps step MPS is left as it is (so
# tests/gpu_multirank.sh, which starts MPS, can call this script for its kccl step). Every step is
# bounded, the whole run by DEADLINE seconds (default 170: later steps shrink or are skipped), and the
# script goes on after a failure so that one run reports everything. The cpu step (CPU tests of the
# transport) is not in the default list: CPU machines run it.
OUT=${OUT:-/tmp/kccl_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KCCL_MPIEXEC=${KCCL_MPIEXEC:-$(command -v mpirun)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# mpirun starts its ranks with the PATH of a login shell: name this python3 (the one with numpy, CuPy)
PY=$(command -v python3)
MPI="$KCCL_MPIEXEC --allow-run-as-root --oversubscribe -x PYTHONPATH -x PYTHONUNBUFFERED"
STEPS=${STEPS:-"info mps compile smoke gpu stress8 bench faults"}
DEADLINE=${DEADLINE:-200}
STEP_MARGIN=5
. "$(dirname "$0")/../../tests/gpu_steps.sh"   # log, left, run
SMOKE="
import numpy as np, cupy as cp
from mpi4py import MPI
from kccl import Communicator
w = MPI.COMM_WORLD
cp.cuda.Device(w.rank % cp.cuda.runtime.getDeviceCount()).use()
c = Communicator.create(w, transport='cuda_ipc', max_floats=4096, depth=3, tags=('t',), timeout=10)
x = cp.full(3072, c.rank + 1, cp.float32)
assert float(c.allreduce(x)[0]) == 3.0
c.barrier()
o, t = c.run_rounds('t', cp.ones((1, 3072), cp.float16), 100)
assert float(o[0, 0]) == 2.0, o
c.shutdown(); print('SMOKE OK', w.rank)"
GPUTEST="$PY -m pytest -v -s -m gpu tests/test_kccl_cuda_gpu.py"
MPS=0
for step in $STEPS; do case $step in
info) { date -u; git log --oneline -1; nvidia-smi; $PY -c "import cupy, mpi4py; print('cupy', cupy.__version__, 'mpi4py', mpi4py.__version__)"; $KCCL_MPIEXEC --version; } >"$OUT/info.log" 2>&1 ;;
mps) if timeout 20 nvidia-cuda-mps-control -d >"$OUT/mps.log" 2>&1; then MPS=1; fi; log "mps started=$MPS" ;;
compile) run compile 90 $PY -c "
import time, cupy; t=time.time()
from kccl.cuda_layout import _module; m=_module()
for k in ('kccl_op','kccl_test_rounds','kccl_test_ll_rounds','kccl_peek'): m.get_function(k)
print('nvrtc compile+load', round(time.time()-t,2), 's')" ;;
smoke) run smoke 45 $MPI -n 2 $PY -c "$SMOKE"
   if [ $? -ne 0 ] && [ $MPS = 1 ]; then log "smoke failed under MPS: retrying without MPS"; echo quit | timeout 10 nvidia-cuda-mps-control; MPS=0
      run smoke_nomps 45 $MPI -n 2 $PY -c "$SMOKE"; fi ;;
cpu) run test_cpu 120 $PY -m pytest -q tests/test_kccl_cuda.py tests/test_kccl_cuda_fake.py ;;
gpu) run test_gpu 300 $GPUTEST -k "host_ops or (stress and not n8)" ;;
stress8) run stress8 100 $GPUTEST -k "stress and n8" ;;
bench) for n in ${BENCH_NS:-1 2 4}; do run bench_n$n 60 $MPI -n $n $PY -m kccl.bench --transport cuda_ipc --iters 1000 --warmup 100; done ;;
faults) run test_faults 130 $GPUTEST -k "silent or killed" ;;
*) log "unknown step $step" ;;
esac; done
[ $MPS = 1 ] && { echo quit | timeout 10 nvidia-cuda-mps-control; log "mps stopped"; }
log "done in ${SECONDS}s"
