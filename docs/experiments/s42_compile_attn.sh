#!/bin/bash
# session 42 (H200): fused + compile with the attention block's fused GEMMs under torch.compile
# (CODA_INDUCTOR_UNDER_COMPILE=none), alone, with a per-mode limit long enough for its first step (session 41's
# two tries were cut at 160 s a mode); the mode's log shows when its first step ends
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
CODA_COMMIT=$CODA_COMMIT timeout 540 python -m coda.bench.step --model llama-1b --modes fused+compile --optimizer coda-adamw --steps 6 --profile-steps 1 --head-reps 1 --timeout 500 --env CODA_INDUCTOR_UNDER_COMPILE=none --out $OUT/step > $OUT/step.log 2>&1
echo step rc=$?
grep -E "first step|^\| (stock|fused)" $OUT/step.log | tail -8
