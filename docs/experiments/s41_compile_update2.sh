#!/bin/bash
# session 41 (H200), last device seconds: the compiled GPU test with the LM head's update in the cross entropy's
# backward under torch.compile, then the fused + compile step alone (no stock row: compare its classes only)
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
timeout 70 python -m pytest -q tests/test_optim_gpu.py -k "compiled" 2>&1 | tail -1
CODA_COMMIT=$CODA_COMMIT timeout 110 python -m coda.bench.step --model llama-1b --modes fused+compile --optimizer coda-adamw --steps 6 --profile-steps 1 --head-reps 1 --timeout 100 --out $OUT/step > $OUT/step.log 2>&1
echo step rc=$?
grep -E "^\| (stock|fused)|ms/step" $OUT/step.log | tail -3
