#!/bin/bash
# needs `git apply docs/experiments/side_job.patch` (session 40: the side job is not in the library)
# session 40: the llama-1b step, fused eager, with the CE's overlapped phases 1 + 2 (side job) and without
# (CODA_CE_SIDE=0), one process each, H200 (CODA_AUTOTUNE unset: shipped configs / heuristic)
CODA_COMMIT=$CODA_COMMIT timeout 290 python -m coda.bench.step --model llama-1b --modes fused --optimizer coda-adamw \
  --env CODA_CE_SIDE=0 --steps 8 --warmup 3 --profile-steps 1 --timeout 140 --out $OUT/step 2>&1 \
  | grep -E "^\| (stock|fused)|other|ce_|Error|error" | tail -20
