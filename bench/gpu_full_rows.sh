#!/bin/bash
# The headline rows of BENCHMARKS.md on the GPU machine, from the repository root:
#   bash bench/gpu_full_rows.sh                 # every step that this machine's GPU count allows
#   STEPS="one lanes" bash bench/gpu_full_rows.sh
# Steps:
#   one    2B shape, one rank on GPU 0: the full table (pp1024, tg512 @ 128, tg128 @ 3968, the PyTorch
#          baselines eager / CUDA graph / torch.compile in the same run)
#   two    2B shape, two ranks, one GPU each (needs 2 GPUs): the same rows without the baselines
#   lanes  issue 30's table: the 2B shape and the one-lane Llama-3.2-1B and SmolLM2-135M shapes as random bf16
#          checkpoints (written under $OUT once), `kog bench --model`, torch.compile in the same run
#   kccl   kccl cuda_ipc between two GPUs (needs 2): in-kernel LL and flag all-reduce, host calls, NCCL
# JSON reports and logs under $OUT (default /tmp/kog_bench_out); the rows name their commit (KOG_COMMIT).
cd "$(dirname "$0")/.." || exit 1
. bench/common.sh
STEPS=${STEPS:-"one two lanes kccl"}
header
rc=0
for step in $STEPS; do case $step in
one)   CUDA_VISIBLE_DEVICES=${GPU:-0} run 2b_one $PY -m kog_cli bench --shape 2b --reps 5 --json-out "$OUT/2b_one.json" || rc=1 ;;
two)   if [ -z "${DRY:-}" ] && [ "${GPUS:-0}" -lt 2 ]; then echo "two: skipped (needs 2 GPUs, $GPUS here)"; continue; fi
       run 2b_np2 $PY -m kog_cli bench --shape 2b --np 2 --reps 3 --baselines none --json-out "$OUT/2b_np2.json" || rc=1 ;;
lanes) # issue 30's rows: random bf16 checkpoints of the shapes (kog_dist/shapes.py's numbers; no rope
       # scaling or biases, which do not change the bytes streamed), then `kog bench --model`
       for s in 2b llama3.2-1b smollm2-135m; do
         case $s in
         2b)           shape=(--lanes 8 --delay 2 --layers 15 --hidden 3072 --heads 32 --kv-heads 16 --ffn 12288
                        --vocab 32000 --window 2048 --window-layers 10) ;;
         llama3.2-1b)  shape=(--lanes 1 --delay 1 --tie --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn 8192
                        --vocab 128256) ;;
         smollm2-135m) shape=(--lanes 1 --delay 1 --tie --layers 30 --hidden 576 --heads 9 --kv-heads 3 --ffn 1536
                        --vocab 49152) ;;
         esac
         d="$OUT/ckpt_$s"
         if [ -n "${DRY:-}" ] || [ ! -f "$d/config.json" ]; then
           run "ckpt_$s" $PY -m kog_cli checkpoint tiny "$d" "${shape[@]}" --dtype BF16 \
             || { rc=1; continue; }
         fi
         CUDA_VISIBLE_DEVICES=${GPU:-0} run "$s" $PY -m kog_cli bench --model "$d" --reps 5 --baselines compile \
           --json-out "$OUT/$s.json" || rc=1
       done ;;
kccl)  if [ -z "${DRY:-}" ] && [ "${GPUS:-0}" -lt 2 ]; then echo "kccl: skipped (needs 2 GPUs, $GPUS here)"; continue; fi
       run kccl_cuda_ipc $PY -m kccl.bench --transport cuda_ipc -n 2 --iters 2000 || rc=1 ;;
*)     echo "unknown step $step (one two lanes kccl)" >&2; exit 2 ;;
esac; done
exit $rc
