#!/bin/bash
# GPU checks of the kccl cuda_ipc transport on one machine (one H200 shared by N ranks under MPS):
# compile, smoke, GPU tests (N = 2, 4, 8), bench (N = 1, 2, 4). Logs under ${OUT:-/tmp/kccl_out}.
# Run from the repository root as root (MPS control); every step is bounded and the script goes on
# after a failure so that one run reports everything.
OUT=${OUT:-/tmp/kccl_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KCCL_MPIEXEC=${KCCL_MPIEXEC:-$(command -v mpirun)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# mpirun starts its ranks with the PATH of a login shell: name this python3 (the one with numpy, CuPy)
PY=$(command -v python3)
MPI="$KCCL_MPIEXEC --allow-run-as-root --oversubscribe -x PYTHONPATH"
STEPS=${STEPS:-"info mps compile smoke tests bench faults"}
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
run() { local name=$1 t=$2; shift 2; local s=$SECONDS; timeout "$t" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
        log "$name rc=$rc $((SECONDS - s))s"; tail -n 25 "$OUT/$name.log" >>"$OUT/summary.txt"; return $rc; }
MPS=0
for step in $STEPS; do case $step in
info) { date -u; nvidia-smi; python3 -c "import cupy, mpi4py; print('cupy', cupy.__version__, 'mpi4py', mpi4py.__version__)"; $KCCL_MPIEXEC --version; } >"$OUT/info.log" 2>&1 ;;
mps) if nvidia-cuda-mps-control -d >"$OUT/mps.log" 2>&1; then MPS=1; fi; log "mps started=$MPS" ;;
compile) run compile 120 python3 -c "
import time, cupy; t=time.time()
from kccl.cuda_ipc import _module; m=_module()
for k in ('kccl_op','kccl_test_rounds','kccl_peek'): m.get_function(k)
print('nvrtc compile+load', round(time.time()-t,2), 's')" ;;
smoke) run smoke 60 $MPI -n 2 $PY -c "
import numpy as np, cupy as cp
from mpi4py import MPI
from kccl import Communicator
w = MPI.COMM_WORLD
c = Communicator.create(w, transport='cuda_ipc', max_floats=4096, depth=3, tags=('t',), timeout=10)
x = cp.full(3072, c.rank + 1, cp.float32)
assert float(c.allreduce(x)[0]) == 3.0
c.barrier()
o, t = c.run_rounds('t', cp.ones((1, 3072), cp.float16), 100)
assert float(o[0, 0]) == 2.0, o
c.shutdown(); print('SMOKE OK', w.rank)"
   if [ $? -ne 0 ] && [ $MPS = 1 ]; then log "smoke failed under MPS: retrying without MPS"; echo quit | nvidia-cuda-mps-control; MPS=0
      run smoke_nomps 60 $MPI -n 2 $PY -c "import sys; sys.exit(0)"; fi ;;
tests) run test_cpu 120 python3 -m pytest -q tests/test_kccl_cuda.py
       run test_gpu 240 python3 -m pytest -v -s -m gpu tests/test_kccl_cuda_gpu.py -k "host_ops or stress" ;;
bench) for n in 1 2 4; do run bench_n$n 90 $MPI -n $n $PY -m kccl.bench --transport cuda_ipc --iters 2000 --warmup 200; done ;;
faults) run test_faults 150 python3 -m pytest -v -s -m gpu tests/test_kccl_cuda_gpu.py -k "silent or killed" ;;
esac; done
[ $MPS = 1 ] && { echo quit | nvidia-cuda-mps-control; log "mps stopped"; }
log done
