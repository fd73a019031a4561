#!/bin/bash
# Session 52's second device call (issue 31, H100): session 52's first call (s51_call2.sh) served every problem of
# the fused eager llama-1b step from the shipped file, but the fused+compile mode's summary said "14 shipped,
# 2 heuristic": inductor lays some operands out otherwise. 1. record the compiled step (`--compile`, new) and tune
# what the heuristic served (its store comes back in $OUT: ship it here with docs/experiments/reship.py);
# 2. the fused eager step twice from the same disk cache (the second's first step: issue 31's warm start, <= 10 s).
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
tune_model "${TUNE_S:-240}" llama1b_compile_s52.json --compile --source heuristic --level near
rm -f ~/.cache/coda/autotune.json  # the steps below: shipped configs only, with the kernels the tuning left cached
for i in ${RUNS-1 2}; do  # RUNS="": the tuning only
  (unset CODA_AUTOTUNE; CODA_AUTOTUNE_SUMMARY=1 timeout ${STEP_S:-100} python -m coda.bench.step --model llama-1b \
      --optimizer coda-adamw --steps 5 --warmup 3 --modes fused --timeout 90 --out "$OUT/warm$i" 2>&1 | \
      grep -E "^\| (fused|mode)|rror|shipped|first" | tail -4)
  grep -o '"first_step_s": [0-9.]*' "$OUT/warm$i/report.json"
done
