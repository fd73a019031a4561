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
# Is the fused eager step host-paced? Its kernels sum to ~113 ms of a 123 ms step (beeed5e). Host time a step with
# the GPU backlogged (CODA_CE_EXP=0: the exp-stored CE's flag read would wait out the backlog), and a cProfile.
(unset CODA_AUTOTUNE; CODA_CE_EXP=0 timeout ${HOST_S:-150} python -m coda.bench.step_host --top 40 > "$OUT/host.txt" 2>&1;
 grep -E "a step|rror" "$OUT/host.txt" | tail -3)
