#!/bin/bash
# Session 47, last device call (H100): GPU tests of the CE exp-stored path, the four-mode step report at the final
# code (README table), then one more alternated CODA_CE_EXP=0 / 1 pair of the fused step.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 2 ${TEST_S:-100} tests/test_cross_entropy_exp.py tests/test_cross_entropy_gpu.py
unset CODA_AUTOTUNE
S="--model llama-1b --optimizer coda-adamw --steps 10 --profile-steps 1"
timeout ${REPORT_S:-330} python -m coda.bench.step $S --head-reps 2 --modes ${MODES:-stock+compile,fused,fused+graph,fused+compile} \
    --timeout 110 --out "$OUT/step" 2>&1 | grep -E "first step|^\| (stock|fused)|rror|shipped" | tail -8
for e in $([ "${AB:-1}" = 1 ] && echo 0 1); do
  CODA_CE_EXP=$e timeout 60 python -m coda.bench.step $S --head-reps 0 --modes fused --timeout 55 --out "$OUT/ab_exp$e" \
      2>&1 | grep -E "^\| fused|rror" | tail -1 | sed "s/^/exp=$e: /"
done
