#!/bin/bash
# Session 44, one call for what must run on a GPU (the device was scarce: ~950 s of failed starts): first the GPU
# tests of the commits not yet GPU-run (2fae1d8 dispatcher QKV, 06fc8e6 per-weight tokens, 09f8f5e deferred dW),
# then the step report at the final code (stock + compile, fused, fused + compile; CODA_AUTOTUNE unset: the shipped
# configs; MODES= a subset, MODES='' none).
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
CODA_AUTOTUNE=0 JOBS=3 PER_FILE_TIMEOUT=190 timeout 195 bash tests/gpu_suite.sh "$OUT/suite" \
    tests/test_optim_gpu.py tests/test_attention_gpu.py tests/test_cross_entropy_gpu.py 2>&1 | tail -4
unset CODA_AUTOTUNE
S="--model llama-1b --optimizer coda-adamw --steps 8 --profile-steps 1 --head-reps 2"
[ -n "${MODES-x}" ] && timeout 285 python -m coda.bench.step $S --modes ${MODES:-stock+compile,fused,fused+compile} --timeout 92 \
    --out "$OUT/step" 2>&1 | grep -E "first step|^\| (stock|fused)|rror|shipped|heuristic" | tail -12
