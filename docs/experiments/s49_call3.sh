#!/bin/bash
# Session 49's third device call (H100): examples/llama_train.py --grad-check --compile --compile-fused in full
# (issue 30's acceptance: every gradient and the loss vs stock float64; s49_call2 kept only its last 40 lines),
# then the whole GPU suite (tests/gpu_suite.sh, JOBS at a time), failures listed.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
(unset CODA_AUTOTUNE; timeout ${GC_S:-150} python examples/llama_train.py --device cuda --grad-check --compile \
    --compile-fused > "$OUT/grad_check.txt" 2>&1; grep -E "^loss|^gradient|^parameter|^max" "$OUT/grad_check.txt")
CODA_AUTOTUNE=0 JOBS=${JOBS:-12} PER_FILE_TIMEOUT=${SUITE_FILE_S:-330} timeout ${SUITE_S:-380} bash tests/gpu_suite.sh \
    "$OUT/suite" 2>&1 | grep -v " rc=0 " | tail -30
grep -h -E "^(FAILED|ERROR)" "$OUT"/suite/*.log 2>/dev/null | head -20
echo "files: $(ls "$OUT"/suite/*.log | wc -l); passed lines: $(grep -l -E "[0-9]+ passed" "$OUT"/suite/*.log | wc -l)"
