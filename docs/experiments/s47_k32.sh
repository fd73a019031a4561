#!/bin/bash
# Session 47, device call 2 (H100): the tile_k = 32 GPU test (fixed shapes), the segment-sum GPU file without its
# opt-in, then s47_k32.py: half-depth stages on the step's heavy GEMMs, ROUNDS interleaved rounds.
cd "$(dirname "$0")/../.." || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 2 ${TEST_S:-150} tests/test_dsl_segment_gpu.py tests/test_gemm_gpu.py::test_half_depth_stages
CODA_AUTOTUNE=0 timeout ${BENCH_S:-300} python docs/experiments/s47_k32.py ${ROUNDS:-4} 2>&1 | tail -6
