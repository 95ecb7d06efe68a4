#!/bin/bash
# GPU run of the multi-rank cuda backend (written without a GPU; never run yet): N ranks on ONE H200
# under MPS. Steps: info, mps, build (NVRTC of N = 1, 2, 4, 8 into CuPy's cache), cpu (CPU tests),
# single (the one-rank GPU tests: the measured path still passes), ids (N = 2, 4, 8 give the one-rank
# greedy / sampled ids), kill (a SIGKILLed rank: the others raise PeerLost), bench (2B shape, bf16,
# random weights: tokens/s for N = 1, 2, 4). Logs and summary.txt under ${OUT:-/tmp/kog_mr_out}.
# From the repository root, as root (MPS control):   bash tests/gpu_multirank.sh
# STEPS="ids kill" bash tests/gpu_multirank.sh  runs a subset. Every step is bounded; a failed step
# does not stop the others.
OUT=${OUT:-/tmp/kog_mr_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KCCL_MPIEXEC=${KCCL_MPIEXEC:-$(command -v mpirun)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
PY=$(command -v python3)
MPI="$KCCL_MPIEXEC --allow-run-as-root --oversubscribe -x PYTHONPATH -x PYTHONUNBUFFERED"
STEPS=${STEPS:-"info mps build cpu single ids kill bench"}
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
run() { local name=$1 t=$2; shift 2; local s=$SECONDS; timeout "$t" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
        log "$name rc=$rc $((SECONDS - s))s"; tail -n 30 "$OUT/$name.log" >>"$OUT/summary.txt"; return $rc; }
MPS=0
for step in $STEPS; do case $step in
info) { date -u; git log --oneline -1; nvidia-smi; $PY -c "import cupy, mpi4py; print('cupy', cupy.__version__, 'mpi4py', mpi4py.__version__)"; $KCCL_MPIEXEC --version; } >"$OUT/info.log" 2>&1 ;;
mps) if nvidia-cuda-mps-control -d >"$OUT/mps.log" 2>&1; then MPS=1; fi; log "mps started=$MPS" ;;
build) run build 600 $PY - <<'PY'
# the tests' and the bench's kernels into CuPy's disk cache, one process per variant
import json, subprocess, sys, time
t0 = time.time()
code = r'''
import sys, cupy as cp
from kog_dist.bench import shape_config
from kog_dist.config import LaneformerConfig
from kog_dist.tiny import TINY_DEFAULTS
from workers.cuda import multirank as mr
from workers.cuda.build import build, default_blocks
which, n = sys.argv[1], int(sys.argv[2])
if which == "tiny":
    d = dict(TINY_DEFAULTS); d.update(num_lanes=8); d["model_type"] = "laneformer_tp"
    cfg, dt = LaneformerConfig.from_dict(d), "F32"
else:
    cfg, dt = shape_config("2b"), "BF16"
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
nb = default_blocks(cfg, sms) if n == 1 else mr.blocks_per_rank(mr.RankView(cfg, 0, n), sms, n)
k = build(cfg, dt, nb, nranks=n, progress=False)
print(which, n, "blocks", nb, "smem", k.smem_bytes, "compile s", round(k.compile_s, 1), flush=True)
'''
ps = [subprocess.Popen([sys.executable, "-c", code, w, str(n)]) for w, n in
      [("tiny", 1), ("tiny", 2), ("tiny", 4), ("tiny", 8), ("2b", 1), ("2b", 2), ("2b", 4)]]
rc = max(p.wait() for p in ps)
print("built in", round(time.time() - t0, 1), "s, rc", rc)
sys.exit(rc)
PY
;;
cpu) run cpu 300 $PY -m pytest -q tests/test_cuda_multirank.py tests/test_cuda_compile.py ;;
single) run single 900 $PY -m pytest -q -m gpu tests/test_cuda_backend.py ;;
ids) run ids 1500 $PY -m pytest -v -s -m gpu tests/test_cuda_multirank.py -k ids_equal ;;
kill) run kill 400 $PY -m pytest -v -s -m gpu tests/test_cuda_multirank.py -k killed ;;
bench) cat >"$OUT/bench_mr.py" <<'PY'
# one rank of the multi-rank bench (2B shape, bf16, random weights, greedy, EOS ignored)
import sys, cupy as cp
from mpi4py import MPI
w = MPI.COMM_WORLD
n = w.size
cp.cuda.Device(w.rank % cp.cuda.runtime.getDeviceCount()).use()
from kog_dist.bench import shape_config
from workers.backend import RunCommand
from workers.cuda import multirank as mr
from workers.cuda.backend import CudaBackend
from workers.cuda.build import build, default_blocks
from workers.cuda.weights import random_weights
cfg, dt, gen = shape_config("2b"), "BF16", int(sys.argv[1])
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
comm = None
if n > 1:
    from kccl import Communicator
    comm = Communicator.create(w, transport="cuda_ipc", **mr.comm_kwargs(cfg, n))
    view = mr.RankView(cfg, w.rank, n)
    nb = mr.blocks_per_rank(view, sms, n)
else:
    view, nb = cfg, default_blocks(cfg, sms)
k = build(cfg, dt, nb, nranks=n, progress=False)
dw = random_weights(view, dt, k, seed=1)
b = CudaBackend(cfg=cfg, weights=dw, comm=comm, nblocks=nb, max_seq=4096, num_slots=1, progress=False)
b.run(RunCommand(append=[1, 2, 3, 4], max_new_tokens=32), ignore_eos=True)          # warm-up
rates = []
for _ in range(3):
    r = b.run(RunCommand(append=[1, 2, 3, 4], max_new_tokens=gen), ignore_eos=True)
    rates.append((len(r.token_ids) - 1) / r.decode_ms * 1e3)
ids = w.gather(r.token_ids[:64], root=0)
if w.rank == 0:
    same = all(x == ids[0] for x in ids)
    print(f"BENCH N={n} blocks/rank={nb} tokens={gen} tokens/s best={max(rates):.1f} all={[round(x, 1) for x in rates]} "
          f"kernel_ms={b.last_kernel_ms:.1f} ranks_same_ids={same}", flush=True)
b.close()
if comm is not None:
    comm.shutdown()
PY
   for n in 1 2 4; do run bench_n$n 300 $MPI -n $n $PY "$OUT/bench_mr.py" 512; done
   grep -h BENCH "$OUT"/bench_n*.log | tee -a "$OUT/summary.txt" ;;
esac; done
[ $MPS = 1 ] && { echo quit | nvidia-cuda-mps-control; log "mps stopped"; }
log done
