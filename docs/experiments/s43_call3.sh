#!/bin/bash
# Session 43, call 3 (H200): the compiled LM head deferral failed on the GPU (a saved 0-d float32 tensor, the
# coda.optim token, bumped before its backward); graph breaks / the failing frame of the GPU test, the copies
# experiment and fused + compile with the deferral off (CODA_CE_DEFER_BUDGET=0) beside the session's other changes.
cd "$(dirname "$0")/../.." || exit 1
export CODA_AUTOTUNE=0
TORCH_LOGS=graph_breaks timeout 120 python -m pytest -q -x tests/test_optim_gpu.py -k "compiled and inductor" 2>&1 \
    | grep -E "Graph break|graph break|Reason|^E |File .*coda|passed|failed" | head -40
CODA_CE_DEFER_BUDGET=0 timeout 100 python docs/experiments/s43_copies.py --layers 2 2>&1 | grep -v Warn | tail -30
CODA_CE_DEFER_BUDGET=0 timeout 200 python -m coda.bench.step --model llama-1b --optimizer coda-adamw --steps 8 \
    --profile-steps 1 --head-reps 2 --modes fused+compile --timeout 150 --out "$OUT/step" 2>&1 \
    | grep -E "first step|^\| (stock|fused)|rror" | tail -4
