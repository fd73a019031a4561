#!/bin/bash
# Session 49's fourth device call (H100): the GPU files where c84dad7's whole suite failed (the exp-stored CE:
# precompile's dry run, the deferred-memory bound, the sync and graph tests) and the CE tests, after the fixes;
# then the four-mode step report of the final code.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 7 ${TEST_S:-200} tests/test_precompile_gpu.py tests/test_optim_gpu.py tests/test_nn_gpu.py \
    tests/test_graphs_gpu.py tests/test_cross_entropy_exp.py tests/test_cross_entropy_gpu.py tests/test_schedule_gpu.py
S="--model llama-1b --optimizer coda-adamw --steps 10 --profile-steps 1 --head-reps 2"
(unset CODA_AUTOTUNE; timeout ${STEP_S:-300} python -m coda.bench.step $S \
    --modes ${MODES:-stock+compile,fused,fused+graph,fused+compile} --timeout 100 --out "$OUT/step" 2>&1 | \
    grep -E "^\| (stock|fused|mode)|rror|shipped" | tail -6)
