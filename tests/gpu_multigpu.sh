#!/bin/bash
# The multi-GPU run (issue 9) on a machine of G GPUs, one rank per GPU, every step bounded and the whole
# run by DEADLINE seconds (default 420). From the repository root, as root with Open MPI's mpirun:
#   bash tests/gpu_multigpu.sh          # logs + summary.txt under ${OUT:-/tmp/kog_mg_out}
# Steps (STEPS= a subset):
#   info   versions, nvidia-smi, nvidia-smi topo -m
#   topo   `kog topo` report and --json, and `kog topo --record` of this machine (topo_fixture.tgz: the fixture)
#   build  the kernels below compiled once, in parallel (2B bf16 for N in NS; tiny fp32 8 lanes N = 1, 2)
#   ids    tests/test_cuda_multirank.py ids test for N = 2: ranks on 2 GPUs give the one-rank and numpy ids
#   kccl   python -m kccl.bench --transport cuda_ipc for N in NS (N > 1), NCCL beside it (ranks on distinct GPUs)
#   bench  tests/bench_multirank.py: 2B decode tokens/s and first ids for N in NS (compare the ids lines);
#          BENCH_PROFILE=1: also every rank's per-phase breakdown of decode step 200
#   kogbench  `kog bench --shape 2b --np N` for N in NS (the user's command: table with GB/s per GPU)
# NS defaults to 1 2 4 8 up to the number of GPUs. NCCL_NVLS_ENABLE=0: no NVLink multicast objects.
OUT=${OUT:-/tmp/kog_mg_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export KCCL_MPIEXEC=${KCCL_MPIEXEC:-$(command -v mpirun)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=$(command -v python3)        # mpirun starts ranks with a login shell's PATH: name this python3
MPI="$KCCL_MPIEXEC --allow-run-as-root -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE"
G=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
NS=${NS:-$(for n in 1 2 4 8; do [ "$n" -le "${G:-1}" ] && echo -n "$n "; done)}
STEPS=${STEPS:-"info topo build ids kccl bench kogbench"}
DEADLINE=${DEADLINE:-420}
K="$PY -m kog_cli"
. "$(dirname "$0")/gpu_steps.sh"   # log, left, run
log "GPUs: $G, N: $NS"
for step in $STEPS; do case $step in
info) { date -u; nvidia-smi; nvidia-smi topo -m; $PY -c "import cupy, mpi4py; print('cupy', cupy.__version__, 'mpi4py', mpi4py.__version__)"; $KCCL_MPIEXEC --version; } >"$OUT/info.log" 2>&1
      sed -n '/GPU0/,/^$/p' "$OUT/info.log" | tee -a "$OUT/summary.txt" ;;
topo) run topo 60 $K topo
      $K topo --json >"$OUT/topo.json" 2>>"$OUT/topo.log"
      # the device tool does not send symlinks back: record under /tmp, ship a tarball
      rm -rf /tmp/kog_topo_fixture
      if $K topo --record /tmp/kog_topo_fixture >>"$OUT/topo.log" 2>&1; then
        tar -C /tmp -czf "$OUT/topo_fixture.tgz" kog_topo_fixture && log "fixture: $OUT/topo_fixture.tgz"
        grep -h "warning" "$OUT/topo.log" | tee -a "$OUT/summary.txt"
      else log "topo --record failed"; fi ;;
build) run build 200 $PY - $NS <<'PY'
import subprocess, sys, time
t0 = time.time()
code = r'''
import sys, cupy as cp
from kog_dist.shapes import shape_config
from kog_dist.config import LaneformerConfig
from kog_dist.tiny import TINY_DEFAULTS
from workers.cuda import multirank as mr
from workers.cuda.build import build, default_blocks
which, n = sys.argv[1], int(sys.argv[2])
if which == "tiny":
    cfg, dt = LaneformerConfig.from_dict(dict(TINY_DEFAULTS, num_lanes=8, model_type="laneformer_tp")), "F32"
else:
    cfg, dt = shape_config("2b"), "BF16"
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
nb = default_blocks(cfg, sms) if n == 1 else mr.blocks_per_rank(mr.RankView(cfg, 0, n), sms, 1)
k = build(cfg, dt, nb, nranks=n, progress=False)
print(which, n, "blocks", nb, "compile s", round(k.compile_s, 1), flush=True)
'''
items = [("tiny", 1), ("tiny", 2)] + [("2b", int(n)) for n in sys.argv[1:]]
rc = max(subprocess.Popen([sys.executable, "-c", code, w, str(n)]).wait() for w, n in items)
print("built in", round(time.time() - t0, 1), "s, rc", rc)
sys.exit(rc)
PY
;;
ids) run ids 150 $PY -m pytest -v -s -m gpu tests/test_cuda_multirank.py -k "ids_equal and 2" ;;
kccl) for n in $NS; do [ "$n" -gt 1 ] && run kccl_n$n 90 $MPI -n $n $PY -m kccl.bench --transport cuda_ipc --iters 2000 --warmup 200; done
      grep -h "ranks on\|kernel allreduce \|kernel LL allreduce\|post/collect (delta=2) pair\|host allreduce\|NCCL" "$OUT"/kccl_n*.log | tee -a "$OUT/summary.txt" ;;
bench) for n in $NS; do run bench_n$n 120 $MPI -n $n $PY tests/bench_multirank.py ${BENCH_TOKENS:-512} ${BENCH_PROFILE:+profile}; done
       grep -h BENCH "$OUT"/bench_n*.log | tee -a "$OUT/summary.txt"
       grep -h -A8 PROFILE "$OUT"/bench_n*.log >>"$OUT/summary.txt" ;;
kogbench) for n in $NS; do run kogbench_n$n 150 $K bench --shape 2b --np $n --ctx 0 --baselines none --reps 3; done
       grep -h "tg512\|copy bandwidth (measured" "$OUT"/kogbench_n*.log | tee -a "$OUT/summary.txt" ;;
*) log "unknown step $step" ;;
esac; done
log "done in ${SECONDS}s"
