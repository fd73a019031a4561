#!/bin/bash
# Session 44, call 1 (H100, a fresh machine: empty kernel and inductor caches): the step report at the final code for
# the README table -- stock + compile, fused, fused + graph, fused + compile, CODA_AUTOTUNE unset (the shipped
# configs: what a user gets); the fused mode's first step is the cold start (issue 31), fused + graph's the warm one.
# Then the GPU test of the compiled update (06fc8e6's per-weight tokens, 2fae1d8's dispatcher QKV).
cd "$(dirname "$0")/../.." || exit 1
unset CODA_AUTOTUNE
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
S="--model llama-1b --optimizer coda-adamw --steps 10 --profile-steps 1 --head-reps 2"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 470 python -m coda.bench.step $S --modes stock+compile,fused,fused+graph,fused+compile --timeout 115 \
    --out "$OUT/step" 2>&1 | grep -E "first step|^\| (stock|fused|the|.coda)|rror|shipped|tuned|heuristic" | tail -14
timeout 100 python -m pytest -q -x tests/test_optim_gpu.py -k compiled 2>&1 | tail -3
