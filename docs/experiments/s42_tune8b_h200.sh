#!/bin/bash
# session 42 (issue 31): tune every GEMM of the fused llama-8b-4l training step (coda.optim.AdamW, batch 2 x 4096)
# on the H200 at the near level, from an empty cache (as s39_tune8b.sh on the H100); the store comes back for
# --ship-from (it is written problem by problem, so a run cut by the limit still returns what it tuned)
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
S=$(date +%s)
timeout 350 python -m coda.autotune --model llama-8b-4l --level near 2>&1 | grep -v "Warning\|warn(" | tail -40
echo "tune wall $(( $(date +%s) - S )) s"
cp ~/.cache/coda/autotune.json $OUT/llama8b4l_near_store_h200.json
