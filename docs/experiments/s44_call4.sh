#!/bin/bash
# Session 44, one call for what must run on a GPU (the device was scarce: ~660 s of failed starts): the step report
# at the final code (stock + compile, fused, fused + compile; CODA_AUTOTUNE unset: the shipped configs) and the GPU
# tests of the commits not yet GPU-run (2fae1d8 dispatcher QKV, 06fc8e6 per-weight tokens, 09f8f5e deferred dW).
cd "$(dirname "$0")/../.." || exit 1
unset CODA_AUTOTUNE
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy's .git is stale}
S="--model llama-1b --optimizer coda-adamw --steps 8 --profile-steps 1 --head-reps 2"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 330 python -m coda.bench.step $S --modes stock+compile,fused,fused+compile --timeout 105 \
    --out "$OUT/step" 2>&1 | grep -E "first step|^\| (stock|fused)|rror|shipped|heuristic" | tail -12
export CODA_AUTOTUNE=0
JOBS=4 PER_FILE_TIMEOUT=220 timeout 235 bash tests/gpu_suite.sh "$OUT/suite" tests/test_optim_gpu.py \
    tests/test_attention_gpu.py tests/test_cross_entropy_gpu.py tests/test_eager_entry.py 2>&1 | tail -6
