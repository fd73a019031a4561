#!/bin/bash
# session 41, call 1 (H200): the GPU checks session 40 could not run (session 39's review mends), then the step
# report at the session's starting code, all four modes (CODA_AUTOTUNE unset: the shipped configs)
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
bash docs/experiments/s40_checks.sh
CODA_COMMIT=$CODA_COMMIT timeout 420 python -m coda.bench.step --model llama-1b --modes stock+compile,fused,fused+graph,fused+compile --optimizer coda-adamw --timeout 150 --out $OUT/step > $OUT/step.log 2>&1
echo step rc=$?
grep -E "^\| (stock|fused)" $OUT/step.log | tail -4
