#!/bin/bash
# session 41 (H200): coda.optim's in-backward update under torch.compile (ops.mlp and ops.embedding update twins):
# the GPU tests, then the step report's stock + compile and fused + compile modes on one machine
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
timeout 150 python -m pytest -q tests/test_optim_gpu.py -k "trains" 2>&1 | tail -3
CODA_COMMIT=$CODA_COMMIT timeout 270 python -m coda.bench.step --model llama-1b --modes stock+compile,fused+compile --optimizer coda-adamw --steps 8 --profile-steps 1 --head-reps 1 --timeout 130 --out $OUT/step > $OUT/step.log 2>&1
echo step rc=$?
grep -E "^\| (stock|fused)|first step|ms/step" $OUT/step.log | tail -8
