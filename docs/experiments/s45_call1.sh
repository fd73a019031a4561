#!/bin/bash
# Session 45, call 1: (1) the GPU tests of the epilogues whose shared-memory addressing changed (RingView: TileMN
# rings, half-width and 1 -> 2 outputs -- mlp, epilogue hook, gated, rmsnorm_linear) and of the commits not yet
# GPU-run (optim: per-weight compile tokens, the sums chain under compile; attention: dispatcher QKV; cross
# entropy: deferred-dW helper), JOBS at a time; (2) the fused llama-1b step, new code vs .ab_old/ (the files before
# RingView), two rounds alternated on this machine (coda.bench.ab_files), CODA_AUTOTUNE unset (shipped configs).
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 7 ${TEST_S:-185} tests/test_mlp_gpu.py tests/test_epilogue_hook_gpu.py tests/test_gated_gpu.py \
    tests/test_rmsnorm_linear_gpu.py tests/test_optim_gpu.py tests/test_attention_gpu.py tests/test_cross_entropy_gpu.py
ab_step ${ROUNDS:-2} ${AB_S:-300}
