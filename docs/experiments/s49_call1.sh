#!/bin/bash
# For session 49's first device call (H100): b21dd36's fix (captured dynamic launches' tile counters in 16-byte
# slots) -- its GPU test, then the four-mode step report (fused + graph failed at feea67b on an 8-byte counter), and
# the GPU tests of the files this session changed that did not run on a GPU. Then docs/experiments/s48_call1.sh
# (the CE follow-up patch's A/B) if device time is left.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
CODA_AUTOTUNE=0 timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_schedule_gpu.py -k "capture" 2>&1 | tail -3
S="--model llama-1b --optimizer coda-adamw --steps 10 --profile-steps 1 --head-reps 2"
(unset CODA_AUTOTUNE; timeout ${STEP_S:-420} python -m coda.bench.step $S \
    --modes ${MODES:-stock+compile,fused,fused+graph,fused+compile} --timeout 110 --out "$OUT/step" 2>&1 | \
    grep -E "first step|^\| (stock|fused|the|.coda)|rror|shipped|tuned|heuristic" | tail -14)
