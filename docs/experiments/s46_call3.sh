#!/bin/bash
# Session 46, call 3 (H100): the epilogue warps' VecN operands read once per tile (s45_ewg_vecn.patch applied):
# (1) the GPU tests of the epilogue-warp kernels (epi_wg, optim, mlp), (2) the fused llama-1b step, new vs .ab_old/
# (epilogue_wg.py before the change), ROUNDS alternated rounds on this machine, CODA_AUTOTUNE unset.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 3 ${TEST_S:-170} tests/test_epi_wg_gpu.py tests/test_optim_gpu.py tests/test_mlp_gpu.py
ab_step ${ROUNDS:-3} ${AB_S:-380}
