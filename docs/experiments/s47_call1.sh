#!/bin/bash
# For the next session's first device call (H100 or H200): the GPU checks of session 46's CPU-built work --
# coda.segment_sum in the kernel (tests/test_dsl_segment_gpu.py; once it passes, drop the CODA_SEGMENT_KERNEL gate
# in coda/dsl_segment.py) -- and the DSL / epilogue GPU files it touches, JOBS at a time.
cd "$(dirname "$0")/../.." || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
CODA_AUTOTUNE=0 JOBS=4 PER_FILE_TIMEOUT=${TEST_S:-240} timeout $((${TEST_S:-240} + 5)) bash tests/gpu_suite.sh "$OUT/suite" \
    tests/test_dsl_segment_gpu.py tests/test_dsl_gpu.py tests/test_epilogue_hook_gpu.py tests/test_mlp_gpu.py \
    2>&1 | tail -6
grep -h -E "^(FAILED|ERROR)|Error|assert" "$OUT"/suite/*.log 2>/dev/null | head -12
