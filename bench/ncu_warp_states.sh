#!/bin/bash
# Nsight Compute's warp states and source counters of one monokernel launch (2B shape, one rank), as in
# BENCHMARKS.md: the first launch it catches is the TTFT row's short decode.
#   bash bench/ncu_warp_states.sh            # report under $OUT (default /tmp/kog_bench_out)
cd "$(dirname "$0")/.." || exit 1
. bench/common.sh
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
header
run ncu_monokernel "$NCU" --clock-control none -k 'regex:^monokernel$' -c 1 --section WarpStateStats \
  --section SourceCounters $PY -m kog_cli bench --shape 2b --baselines none --ctx 0 --pp 64 --gen 64 --reps 1
