#!/bin/bash
# Session 43, call 2 (H200): after the compile changes (attention fused under compile by default, enable_gqa there,
# the LM head's deferred dW + update under compile, the O -> MLP norm chain under compile): where the compiled
# step's copies come from (2 layers), the step report (stock + compile, fused, fused + compile), the GPU tests.
cd "$(dirname "$0")/../.." || exit 1
export CODA_AUTOTUNE=0
S="--model llama-1b --optimizer coda-adamw --steps 8 --profile-steps 1 --head-reps 2"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 100 python docs/experiments/s43_copies.py --layers 2 2>&1 | grep -v Warn | tail -30
timeout 300 python -m coda.bench.step $S --modes stock+compile,fused,fused+compile --timeout 95 --out "$OUT/step" 2>&1 \
    | grep -E "first step|^\| (stock|fused)|rror" | tail -8
timeout 110 python -m pytest -q -x tests/test_optim_gpu.py -k compiled 2>&1 | tail -3
