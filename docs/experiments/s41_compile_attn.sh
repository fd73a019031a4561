#!/bin/bash
# session 41 (H200): fused + compile with the attention block's fused GEMMs under torch.compile
# (CODA_INDUCTOR_UNDER_COMPILE=none) against the default (the attention half left to inductor), one machine.
# (The first try with stock + compile in the same run timed out at 560 s before the fused + compile modes ended.)
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
CODA_COMMIT=$CODA_COMMIT timeout 330 python -m coda.bench.step --model llama-1b --modes fused+compile --optimizer coda-adamw --steps 6 --profile-steps 1 --head-reps 1 --timeout 160 --env CODA_INDUCTOR_UNDER_COMPILE=none --out $OUT/step > $OUT/step.log 2>&1
echo step rc=$?
grep -E "^\| (stock|fused)" $OUT/step.log | tail -6
