#!/bin/bash
# Session 49's first device call (H100): b21dd36's fix (captured dynamic launches' tile counters in 16-byte slots)
# -- its GPU test --, the GPU tests of the files session 48's review changed (epilogues/rope.py's one permutation
# helper and shared _rotate, the CE's ones factors made once), then the four-mode step report (fused + graph failed
# at feea67b on an 8-byte counter). Then docs/experiments/s49_call2.sh (the CE follow-up patch's A/B, grad-check).
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 6 ${TEST_S:-170} tests/test_schedule_gpu.py tests/test_rope_gpu.py tests/test_rope_qknorm.py \
    tests/test_attention_gpu.py tests/test_attention_qknorm.py tests/test_cross_entropy_exp.py
S="--model llama-1b --optimizer coda-adamw --steps 10 --profile-steps 1 --head-reps 2"
(unset CODA_AUTOTUNE; timeout ${STEP_S:-400} python -m coda.bench.step $S \
    --modes ${MODES:-stock+compile,fused,fused+graph,fused+compile} --timeout 100 --out "$OUT/step" 2>&1 | \
    grep -E "first step|^\| (stock|fused|the|.coda)|rror|shipped|tuned|heuristic" | tail -14)
