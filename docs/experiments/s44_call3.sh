#!/bin/bash
# Session 44, call 3 (H100): the GPU suite at the final code -- the files the last sessions' changes touch
# (cross entropy: 09f8f5e's deferred-dW helper; optim: per-weight tokens; nn / attention: the dispatcher QKV) and
# test_dsl_gpu (not run since session 42), one process per file (per test id for test_dsl_gpu), JOBS at a time.
cd "$(dirname "$0")/../.." || exit 1
export CODA_AUTOTUNE=0
JOBS=${JOBS:-12} PER_FILE_TIMEOUT=${PER_FILE_TIMEOUT:-420} timeout 560 bash tests/gpu_suite.sh "$OUT/suite" \
    tests/test_cross_entropy_gpu.py tests/test_optim_gpu.py tests/test_nn_gpu.py tests/test_ce_grad_gpu.py \
    tests/test_graphs_gpu.py tests/test_precompile_gpu.py tests/test_dsl_gpu.py 2>&1 | tail -60
