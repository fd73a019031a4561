#!/bin/bash
# Session 50's second device call (H100): the fused llama-1b step, 78de665 (the CE's range flag read behind an
# event, the dX GEMM queued first) against .ab_old/ (ops/cross_entropy_fast.py of 11e6de6: bool(ok.all()) drains
# the stream), ROUNDS alternated rounds; then the host time of a step; the whole GPU suite (SUITE=0: not).
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
ab_step ${ROUNDS:-3} ${AB_S:-330}
# Is the fused eager step host-paced? Host time a step with the GPU backlogged (CODA_CE_EXP=0: the CE's flag read
# would wait out the backlog), and a cProfile.
(unset CODA_AUTOTUNE; CODA_CE_EXP=0 timeout ${HOST_S:-140} python -m coda.bench.step_host --top 40 > "$OUT/host.txt" 2>&1;
 grep -E "a step|rror" "$OUT/host.txt" | tail -3)
[ "${SUITE:-1}" = 1 ] && CODA_AUTOTUNE=0 JOBS=${JOBS:-12} PER_FILE_TIMEOUT=${SUITE_FILE_S:-230} \
    timeout ${SUITE_S:-250} bash tests/gpu_suite.sh "$OUT/suite" 2>&1 | grep -v " rc=0 " | tail -20
cat "$OUT"/suite/0_failures.txt 2>/dev/null | head -30
