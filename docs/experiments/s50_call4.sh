#!/bin/bash
# Session 50's last device call (H100; not run: no device time left): the CE flag's GPU tests, then more rounds
# of call 2's A/B (the event-ordered flag read of 78de665 vs 11e6de6's bool(ok.all()) in .ab_old/), AB_STEPS timed
# steps a side.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 2 ${TEST_S:-90} tests/test_nn_gpu.py tests/test_cross_entropy_exp.py
AB_STEPS=${AB_STEPS:-20} ab_step ${ROUNDS:-2} ${AB_S:-200}
