#!/bin/bash
# Session 47, first device call (H100): (1) the GPU checks of session 46's CPU-built segment sums
# (tests/test_dsl_segment_gpu.py) and of tile_k = 32 (half-depth stages: test_gemm_gpu -k half_depth, the epilogue
# warps' tests); (2) what tile_k = 32 buys the epilogue-warp GEMMs of the llama-1b step, whose 64 KB staged tile
# leaves 3 stages of 64 k-elements (48 KB) at 128 x 256: the same bytes as 6 stages of 32 (coda.bench.epi_wg,
# do_bench medians, one process).
cd "$(dirname "$0")/../.." || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 3 ${TEST_S:-200} tests/test_dsl_segment_gpu.py tests/test_epi_wg_gpu.py \
    tests/test_gemm_gpu.py::test_half_depth_stages
V="cluster_m=2;cluster_m=2,tile_k=32;cluster_m=2,tile_k=32,stages=4;cluster_m=1,cluster_n=2;cluster_m=1,cluster_n=2,tile_k=32"
V="$V;epi_wg=0,cluster_m=2;epi_wg=0,cluster_m=2,tile_k=32"
CODA_AUTOTUNE=0 timeout ${BENCH_S:-240} python -m coda.bench.epi_wg --no-ewg --only adamw,adamw_wide,adamw_plain,swiglu_fwd,radial \
    --variants "$V" 2>&1 | tail -8
