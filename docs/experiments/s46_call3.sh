#!/bin/bash
# Session 46, call 3 (H100): the epilogue warps' VecN operands read once per tile (s45_ewg_vecn.patch applied):
# (1) the GPU tests of the epilogue-warp kernels (epi_wg, optim, mlp), (2) the fused llama-1b step, new vs .ab_old/
# (epilogue_wg.py before the change), ROUNDS alternated rounds on this machine, CODA_AUTOTUNE unset.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
CODA_AUTOTUNE=0 JOBS=3 PER_FILE_TIMEOUT=${TEST_S:-170} timeout $((${TEST_S:-170} + 5)) bash tests/gpu_suite.sh "$OUT/suite" \
    tests/test_epi_wg_gpu.py tests/test_optim_gpu.py tests/test_mlp_gpu.py 2>&1 | tail -5
grep -h -E "^(FAILED|ERROR)|Error|assert" "$OUT"/suite/*.log 2>/dev/null | head -12
unset CODA_AUTOTUNE
S="--model llama-1b --optimizer coda-adamw --steps 8 --profile-steps 1 --head-reps 0 --modes fused --timeout 80"
timeout ${AB_S:-380} python -m coda.bench.ab_files .ab_old ${ROUNDS:-3} -- python -m coda.bench.step $S \
    --out "$OUT/ab_{ab}_{round}" 2>&1 | grep -E "^=== round|^\| fused|rror" | tail -14
