#!/bin/bash
# For the next session's first device call (H100 or H200): the GPU checks of session 46's CPU-built work --
# coda.segment_sum in the kernel (tests/test_dsl_segment_gpu.py; once it passes, drop the CODA_SEGMENT_KERNEL gate
# in coda/dsl_segment.py) -- and the DSL / epilogue GPU files it touches, JOBS at a time.
cd "$(dirname "$0")/../.." || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 4 ${TEST_S:-240} tests/test_dsl_segment_gpu.py tests/test_dsl_gpu.py tests/test_epilogue_hook_gpu.py \
    tests/test_mlp_gpu.py
