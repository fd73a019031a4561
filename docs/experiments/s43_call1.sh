#!/bin/bash
# Session 43, call 1 (H200): GPU check of 0668e09 (inductor fallbacks: the compiled fused tiny Llama, both attention
# variants) and the step report: stock + compile and fused eager (A); fused + compile as it is and with the
# attention fused under compile, CODA_INDUCTOR_UNDER_COMPILE=none (B: a variant beside its base), one warm machine.
cd "$(dirname "$0")/../.." || exit 1
export CODA_AUTOTUNE=0
S="--model llama-1b --optimizer coda-adamw --steps 8 --profile-steps 1 --head-reps 2"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 110 python -m pytest -q -x tests/test_optim_gpu.py -k compiled 2>&1 | tail -3
timeout 200 python -m coda.bench.step $S --modes stock+compile,fused --timeout 95 --out "$OUT/step_a" 2>&1 \
    | grep -E "first step|^\| (stock|fused)|rror" | tail -8
timeout 260 python -m coda.bench.step $S --modes fused+compile --env CODA_INDUCTOR_UNDER_COMPILE=none --timeout 125 \
    --out "$OUT/step_b" 2>&1 | grep -E "first step|^\| (stock|fused)|rror" | tail -8
