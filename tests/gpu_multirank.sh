#!/bin/bash
# GPU run of the multi-rank cuda backend: N ranks on ONE H200 under MPS, every step bounded, the whole run
# bounded by DEADLINE seconds (default 300; later steps shrink or are skipped), about 3-4 min in all.
# From the repository root, as root (MPS control), with pyzmq importable (the serve step needs it):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
#   bash tests/gpu_multirank.sh                 # logs + summary.txt under ${OUT:-/tmp/kog_mr_out}
#   STEPS="ids kill" bash tests/gpu_multirank.sh  # a subset (the build step first if the cache is cold)
# Default steps, in order:
#   info   versions, nvidia-smi, commit
#   mps    nvidia-cuda-mps-control -d (stopped again at the end if this script started it)
#   build  every kernel below compiled once, in parallel, into CuPy's disk cache (tiny fp32 8 lanes N = 1, 2,
#          4, 8; the serve model N = 2; 2B bf16 N = 1, 2, 4)
#   ids    tests/test_cuda_multirank.py -k ids_equal: N = 2, 4, 8 ranks give the one-rank kernel's ids
#          (greedy 128 tokens, a continued request, seeded sampling) and the numpy engine's
#   serve  kog-worker --backend cuda under mpirun -n 2 with the control plane on tcp://127.0.0.1:PORT:
#          `kog client generate --json` against `kog generate --backend cpu` (SERVED_MR EQUAL), then
#          SIGTERM to mpirun and its exit code; then `kog generate --np 2` with --backend auto (AUTO_NP2:
#          auto must pick cuda when every rank sees a GPU, and give the same ids)
#   kccl8  kccl/device/run_gpu_checks.sh STEPS="compile stress8": the transport's N = 8 stress (3000 rounds)
#   kill   -k killed_rank_makes: 4 ranks, rank 3 SIGKILLed mid-decode / between two requests: the others
#          raise PeerLost (or KcclTimeout naming it) within the 5 s kccl timeout + 5 s and exit 1 (late in
#          the list: should a dead rank's in-flight work upset the MPS server, only the bench comes after)
#   bench  2B shape, bf16, random weights, 512 tokens: tokens/s for N = 1, 2, 4 ranks (BENCH_NS, BENCH_TOKENS)
# Optional steps: cpu (the CPU tests of the multi-rank code), single (the one-rank GPU tests,
# tests/test_cuda_backend.py -m gpu, ~1-2 min more). A failed step does not stop the others.
OUT=${OUT:-/tmp/kog_mr_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KCCL_MPIEXEC=${KCCL_MPIEXEC:-$(command -v mpirun)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
PY=$(command -v python3)        # mpirun starts ranks with a login shell's PATH: name this python3
MPI=${MR_MPI:-"$KCCL_MPIEXEC --allow-run-as-root --oversubscribe -x PYTHONPATH -x PYTHONUNBUFFERED"}   # MR_MPI: another launcher line
SERVE_BACKEND=${SERVE_BACKEND:-cuda}           # cpu: a dry run of the serve step on a machine without a GPU
STEPS=${STEPS:-"info mps build ids serve kccl8 kill bench"}
DEADLINE=${DEADLINE:-300}
SM=${SERVE_MODEL:-/tmp/kog_mr_serve_model}     # the serve step's checkpoint (tiny, fp32, 8 lanes)
K="$PY -m kog_cli"
STEP_TAIL=30
. "$(dirname "$0")/gpu_steps.sh"   # log, left, run
serve_model() {
  [ -f "$SM/config.json" ] || timeout 60 $K checkpoint tiny "$SM" --lanes 8 --layers 4 --heads 16 --kv-heads 8 \
      --hidden 256 --ffn 512 --delay 2 --window 16 --window-layers 2 --dtype f32 --seed 3
}

same_ids() {   # same_ids CPU.json OTHER.json LABEL: one verdict line "LABEL EQUAL True|False ..."
  $PY - "$@" <<'PY'
import json, sys
a = json.load(open(sys.argv[1]))
try:
    b = json.load(open(sys.argv[2]))
except Exception as e:  # noqa: BLE001
    sys.exit(print(sys.argv[3], "EQUAL False (no answer:", repr(e)[:200], ")"))
eq = a["token_ids"] == b["token_ids"]
print(sys.argv[3], "EQUAL", eq, "tokens", len(b["token_ids"]), "backend", b.get("backend"), "ranks", b.get("ranks"),
      "stats", b.get("stats"))
if not eq:
    print("  cpu   ", a["token_ids"]); print("  other ", b["token_ids"])
PY
}
serve_mr() {   # the serve step; prints to stdout (serve.log), its verdict lines start with SERVED_MR / AUTO_NP2
  local ids=1,5,9,40 n=48 port ep w rc t0
  serve_model || { echo "SERVED_MR no model"; return 1; }
  timeout 60 $K generate --model "$SM" --backend cpu --prompt-ids $ids -n $n --json >"$OUT/serve_cpu.json" \
      || { echo "SERVED_MR cpu generate failed"; return 1; }
  port=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  ep=tcp://127.0.0.1:$port
  $MPI -n 2 $PY -m workers --model "$SM" --backend $SERVE_BACKEND --bind none --control $ep >"$OUT/serve_workers.log" 2>&1 &
  w=$!
  t0=$SECONDS
  until timeout 10 $K client --connect $ep --timeout 2 health >"$OUT/serve_health.log" 2>&1; do
    if ! kill -0 $w 2>/dev/null; then echo "SERVED_MR the workers exited before answering"; break; fi
    if [ $((SECONDS - t0)) -ge 90 ]; then echo "SERVED_MR no health answer in 90 s"; break; fi
    sleep 0.5
  done
  echo "health answered after $((SECONDS - t0)) s: $(tr '\n' ' ' <"$OUT/serve_health.log" | cut -c1-300)"
  timeout 70 $K client --connect $ep --timeout 60 generate --prompt-ids $ids -n $n --json >"$OUT/serve_mr.json"
  echo "client generate rc=$?"
  same_ids "$OUT/serve_cpu.json" "$OUT/serve_mr.json" SERVED_MR
  kill -TERM $w 2>/dev/null
  t0=$SECONDS
  while kill -0 $w 2>/dev/null && [ $((SECONDS - t0)) -lt 30 ]; do sleep 0.5; done
  if kill -0 $w 2>/dev/null; then echo "SERVED_MR mpirun still running 30 s after SIGTERM: SIGKILL"; kill -KILL $w; fi
  wait $w; rc=$?
  echo "SERVED_MR mpirun exit code after SIGTERM: $rc (after $((SECONDS - t0)) s)"
  grep -h "kog-worker\|kog\]\|error\|Error" "$OUT/serve_workers.log" | head -20
  # --backend auto with 2 ranks, through kog generate --np 2 (workers --oneshot under the detected launcher)
  if [ "$(left)" -lt 100 ]; then echo "AUTO_NP2 skipped: deadline"; return 0; fi
  timeout 90 $K generate --np 2 --backend auto --model "$SM" --prompt-ids $ids -n $n --json \
      >"$OUT/auto_np2.json" 2>"$OUT/auto_np2.err"
  echo "kog generate --np 2 --backend auto rc=$?"; tail -n 5 "$OUT/auto_np2.err"
  same_ids "$OUT/serve_cpu.json" "$OUT/auto_np2.json" AUTO_NP2
}

MPS=0
for step in $STEPS; do case $step in
info) { date -u; git log --oneline -1; nvidia-smi; $PY -c "import cupy, mpi4py; print('cupy', cupy.__version__, 'mpi4py', mpi4py.__version__)"; $PY -c "import zmq; print('pyzmq', zmq.__version__)"; $KCCL_MPIEXEC --version; } >"$OUT/info.log" 2>&1
      log "info: $(grep -m1 -o 'NVIDIA H[0-9A-Za-z ]*' "$OUT/info.log") $(grep -m1 '^cupy' "$OUT/info.log") $(grep -m1 '^pyzmq' "$OUT/info.log" || echo 'NO pyzmq (serve will fail)')" ;;
mps) if timeout 20 nvidia-cuda-mps-control -d >"$OUT/mps.log" 2>&1; then MPS=1; fi; log "mps started=$MPS" ;;
build) serve_model >"$OUT/serve_model.log" 2>&1
   SERVE_MODEL=$SM run build 150 $PY - <<'PY'
# the tests', the serve step's and the bench's kernels into CuPy's disk cache, one process per variant
import os, subprocess, sys, time
t0 = time.time()
code = r'''
import os, sys, cupy as cp
from kog_dist.shapes import shape_config
from kog_dist.config import LaneformerConfig, load_config
from kog_dist.tiny import TINY_DEFAULTS
from workers.cuda import multirank as mr
from workers.cuda.build import build, default_blocks
which, n = sys.argv[1], int(sys.argv[2])
if which == "tiny":      # tests/test_cuda_multirank.py's tiny_l8 (and the killed-rank test's model)
    d = dict(TINY_DEFAULTS); d.update(num_lanes=8); d["model_type"] = "laneformer_tp"
    cfg, dt = LaneformerConfig.from_dict(d), "F32"
elif which == "serve":
    cfg, dt = load_config(os.environ["SERVE_MODEL"]), "F32"
else:
    cfg, dt = shape_config("2b"), "BF16"
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
nb = default_blocks(cfg, sms) if n == 1 else mr.blocks_per_rank(mr.RankView(cfg, 0, n), sms, n)
k = build(cfg, dt, nb, nranks=n, progress=False)
print(which, n, "blocks", nb, "smem", k.smem_bytes, "compile s", round(k.compile_s, 1), flush=True)
'''
variants = [("tiny", 1), ("tiny", 2), ("tiny", 4), ("tiny", 8), ("2b", 1), ("2b", 2), ("2b", 4)]
if os.path.exists(os.path.join(os.environ["SERVE_MODEL"], "config.json")):
    variants.append(("serve", 2))
ps = [subprocess.Popen([sys.executable, "-c", code, w, str(n)]) for w, n in variants]
rc = max(p.wait() for p in ps)
print("built", len(variants), "variants in", round(time.time() - t0, 1), "s, rc", rc)
sys.exit(rc)
PY
;;
cpu) run cpu 300 $PY -m pytest -q tests/test_cuda_multirank.py tests/test_cuda_compile.py ;;
single) run single 240 $PY -m pytest -q -m gpu tests/test_cuda_backend.py ;;
ids) run ids 250 $PY -m pytest -v -s -m gpu tests/test_cuda_multirank.py -k ids_equal ;;
kill) run kill 230 $PY -m pytest -v -s -m gpu tests/test_cuda_multirank.py -k killed_rank_makes ;;
serve) if [ "$(left)" -lt 60 ]; then log "serve skipped: past the ${DEADLINE} s deadline"; continue; fi
   s=$SECONDS; serve_mr >"$OUT/serve.log" 2>&1   # not under timeout (a shell function): each command in it is bounded
   log "serve rc=$? $((SECONDS - s))s"; grep -h "^SERVED_MR\|^AUTO_NP2" "$OUT/serve.log" | tee -a "$OUT/summary.txt"
   tail -n 30 "$OUT/serve.log" >>"$OUT/summary.txt" ;;
kccl8) run kccl8 130 env OUT="$OUT/kccl" STEPS="compile stress8" DEADLINE=125 bash kccl/device/run_gpu_checks.sh ;;
bench)
   for n in ${BENCH_NS:-1 2 4}; do run bench_n$n 90 $MPI -n $n $PY tests/bench_multirank.py ${BENCH_TOKENS:-512}; done
   grep -h BENCH "$OUT"/bench_n*.log | tee -a "$OUT/summary.txt" ;;
*) log "unknown step $step" ;;
esac; done
[ $MPS = 1 ] && { echo quit | timeout 10 nvidia-cuda-mps-control; log "mps stopped"; }
log "done in ${SECONDS}s"
