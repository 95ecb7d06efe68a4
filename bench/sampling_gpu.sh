#!/bin/bash
# Sampled decode on the GPU (the monokernel's sampler, workers/cuda/mk_sample.cuh): tokens/s of greedy and of
# sampled rows, each with the sampler before (CFG_SAMPLE_M=0: the whole vocabulary sorted by one block, every
# token) and now (the candidates near the maximum, the full sort only where they cannot decide), in one run.
# The real default model where ~/.cache/kog_dist holds it (bench/put_model.sh), and the llama3.2-1b shape (random
# weights, V = 128256), or SOURCES=smol (the smollm2-135m shape); ROWS picks the samplers (greedy t1 t07p09
# t01). The model's rows decode from a chat prompt (TEXT), the shapes' from random ids. From the repository root with .whl carried; logs under $OUT, the rows in $OUT/sampling.txt.
#   bash bench/sampling_gpu.sh                  # ROWS="greedy t1 t07p09" by default; REPS=3 GEN=256
cd "$(dirname "$0")/.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/sampling_out}
mkdir -p "$OUT"
REPS=${REPS:-3}; GEN=${GEN:-256}
MODEL=$HOME/.cache/kog_dist/SmolLM2-135M-Instruct.Q4_1.gguf
{ date -u; nvidia-smi -L | head -1; } | tee "$OUT/sampling.txt"
row() {   # row NAME ARGS...: one kog bench, its tg row into sampling.txt
  local name=$1; shift
  timeout ${ROW_S:-150} python3 -m kog_cli bench "$@" --reps $REPS --gen $GEN --pp 16 --ctx 0 --baselines none \
    > "$OUT/$name.log" 2>&1
  echo "$name | $(grep -E '^\| monokernel.*tg' "$OUT/$name.log" | head -2 | tr -s ' ' | tr '\n' ' ')" | tee -a "$OUT/sampling.txt"
}
for src in ${SOURCES:-model 1b}; do
  case $src in
    model) [ -f "$MODEL" ] || { echo "no default model here (bench/put_model.sh)" | tee -a "$OUT/sampling.txt"; continue; }
           # a real prompt (kog bench --text): the model's own distribution, not that after random ids
           a=(--model "$MODEL" --dtype ${DTYPE:-q4_1} --text "${TEXT:-Write a short story about a lighthouse keeper.}") ;;
    1b) a=(--shape llama3.2-1b --dtype bf16) ;;
    smol) a=(--shape smollm2-135m --dtype bf16) ;;
  esac
  for r in ${ROWS:-greedy t1 t07p09}; do
    case $r in
      greedy) row "${src}_greedy" "${a[@]}" ;;
      t1) s=(--temperature 1.0 --seed 7) ;;
      t07p09) s=(--temperature 0.7 --top-p 0.9 --seed 7) ;;
      t01) s=(--temperature 0.1 --seed 7) ;;     # random weights: a peaked distribution (theirs is flat at 1)
    esac
    [ $r = greedy ] && continue
    row "${src}_${r}_fullsort" "${a[@]}" "${s[@]}" --define CFG_SAMPLE_M=0
    row "${src}_${r}" "${a[@]}" "${s[@]}"
  done
done
