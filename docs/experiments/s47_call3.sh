#!/bin/bash
# Session 47 (H100): the cross entropy's exp-stored phases (ops/cross_entropy_fast.py: no ce_grad pass) -- GPU tests,
# then the step: stock + compile and fused in one process (the goal's ratio), then fused with CODA_CE_EXP=0 / 1
# alternated (the change on one machine). CODA_AUTOTUNE unset (shipped configs).
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 3 ${TEST_S:-150} tests/test_cross_entropy_exp.py tests/test_cross_entropy_gpu.py \
    tests/test_gemm_gpu.py::test_half_depth_stages
unset CODA_AUTOTUNE
S="--model llama-1b --optimizer coda-adamw --steps 10 --profile-steps 1 --head-reps 0"
timeout ${REPORT_S:-230} python -m coda.bench.step $S --modes stock+compile,fused --timeout 110 --out "$OUT/step" 2>&1 | \
    grep -E "first step|^\| (stock|fused)|rror" | tail -6
for r in 1 2; do
  for e in 0 1; do
    CODA_CE_EXP=$e timeout 80 python -m coda.bench.step $S --modes fused --timeout 70 --out "$OUT/ab_exp${e}_$r" 2>&1 | \
        grep -E "^\| fused|rror" | tail -2 | sed "s/^/exp=$e round $r: /"
  done
done
