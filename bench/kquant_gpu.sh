#!/bin/bash
# Issue 52 on the GPU machine, one call: the K-quant GPU tests, then `kog bench` rows of every storage of the
# llama3.1-8b and llama3.2-1b shapes (random weights made on the device; copy bandwidth measured in the same
# run). From the repo root with the wheels in .whl (../shared/tools/device-wheels.sh gguf==0.19.0
# starlette==1.10.0 uvicorn==0.54.0). STEPS picks steps (default "tests prebuild 8b real8b 1b"; also "ab" with ABS="DEFINE=V ..." and DTAB); DT8 / DT1 the
# --dtype lists; logs and JSON reports under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/kquant_gpu}
mkdir -p "$OUT"
DT8=${DT8:-bf16,q4_0,q4_k_m}
DT1=${DT1:-bf16,q4_0,q4_k,q4_k_m,q6_k}
BENCH="python3 -m kog_cli bench --reps 3 --gen 256 --pp 512 --ctx 0 --baselines none --json"
echo "commit $(git describe --always --dirty 2>/dev/null); $(nvidia-smi -L | head -1)" | tee "$OUT/summary.txt"
for step in ${STEPS:-tests prebuild 8b real8b 1b}; do case $step in
tests)    timeout ${TT:-170} python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_cuda_kquant.py \
            "tests/test_cuda_llama.py::test_quantized_greedy_matches_numpy_engine" > "$OUT/tests.txt" 2>&1
          tail -3 "$OUT/tests.txt" | tee -a "$OUT/summary.txt" ;;
prebuild) python3 - "$DT8" "$DT1" <<'PY' 2>&1 | tail -2
import sys
from kog_dist.shapes import shape_config
from workers.factory import STORE_NAMES
from workers.cuda.build import prebuild
items = [(shape_config(s), STORE_NAMES[d]) for s, dts in (("llama3.1-8b", sys.argv[1]), ("llama3.2-1b", sys.argv[2]))
         for d in dts.split(",")]
prebuild(items)
PY
          ;;
8b)       timeout 150 $BENCH --shape llama3.1-8b --dtype "$DT8" > "$OUT/bench_8b.json" 2> "$OUT/bench_8b.log"
          tail -4 "$OUT/bench_8b.log" | tee -a "$OUT/summary.txt" ;;
1b)       timeout 100 $BENCH --shape llama3.2-1b --dtype "$DT1" > "$OUT/bench_1b.json" 2> "$OUT/bench_1b.log"
          tail -4 "$OUT/bench_1b.log" | tee -a "$OUT/summary.txt" ;;
real8b)   # a Q4_K_M file of the llama3.1-8b shape (kog checkpoint tiny's llama.cpp mix), loaded as stored
          python3 -m kog_cli checkpoint tiny /tmp/l8-q4km.gguf --shape llama3.1-8b --format gguf --dtype q4_k_m \
            > "$OUT/real8b_write.log" 2>&1
          timeout 130 $BENCH --model /tmp/l8-q4km.gguf > "$OUT/bench_real8b.json" 2> "$OUT/bench_real8b.log"
          tail -4 "$OUT/bench_real8b.log" | tee -a "$OUT/summary.txt"; rm -f /tmp/l8-q4km.gguf ;;
ab)       for v in base ${ABS:-CFG_QUB=12 CFG_QUB=16}; do   # A/B of defines (CFG_QUB: loads in flight a lane in the
            # quantized row loops, default 8; CFG_PF: the L2 prefetch a block, bytes), the default build first
            d=$([ "$v" = base ] || echo "--define $v")
            timeout 150 $BENCH --shape llama3.1-8b --dtype "${DTAB:-q4_k_m}" $d \
              > "$OUT/bench_ab_$v.json" 2> "$OUT/bench_ab_$v.log"
            echo "$v: $(grep -h 'tg' "$OUT/bench_ab_$v.log" | tail -1)" | tee -a "$OUT/summary.txt"
          done ;;
esac; done
python3 - "$OUT" <<'PY'
import json, os, sys
for f in ("bench_8b.json", "bench_real8b.json", "bench_1b.json"):
    p = os.path.join(sys.argv[1], f)
    if not os.path.exists(p) or not os.path.getsize(p):
        continue
    r = json.load(open(p))
    print(f"{r['model']}  {r['device']}  copy {r['copy_bandwidth_GBps']:.0f} GB/s")
    for v in r["variants"]:
        tg = v.get("tg", {})
        print(f"  {v['dtype']:>10}  {tg.get('tokens_per_s', 0):8.1f} tok/s  {v['streamed_bytes_per_token']/1e9:6.3f} GB"
              f"  {100 * tg.get('fraction_of_copy_bw', 0):5.1f}% BW  TTFT pp512 {v.get('pp', {}).get('ttft_ms', 0):.1f} ms")
PY
