#!/bin/bash
# Session 50's first device call (H100): the GPU files that session 49 could not re-run after its last fixes
# (e1ac618: kernel row scaling only in the eager backward; f87646f: the forward's row scaling through
# cross_entropy_fast.scale_rows), then the four-mode step report (fused + compile failed at beeed5e).
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 4 ${TEST_S:-200} tests/test_optim_gpu.py tests/test_nn_gpu.py tests/test_cross_entropy_exp.py \
    tests/test_cross_entropy_gpu.py
S="--model llama-1b --optimizer coda-adamw --steps 10 --profile-steps 1 --head-reps 2 --power"
(unset CODA_AUTOTUNE; timeout ${STEP_S:-300} python -m coda.bench.step $S \
    --modes ${MODES:-stock+compile,fused,fused+graph,fused+compile} --timeout 100 --out "$OUT/step" 2>&1 | \
    grep -E "^\| (stock|fused|mode)|rror|shipped" | tail -8)
# Where does the fused eager step idle? Its kernels sum to ~113 ms of a 123 ms step (beeed5e, stock + compile
# 133 of 136). Three steps back to back, only the GPU's activity profiled; the trace comes back for the analysis.
(unset CODA_AUTOTUNE; timeout ${GAPS_S:-140} python -m coda.bench.step_gaps --optimizer coda-adamw --steady 3 --top 25 \
    --trace "$OUT/steady_fused.json.gz" > "$OUT/gaps.txt" 2>&1; grep -E "per_step|rror" "$OUT/gaps.txt" | tail -4)
