#!/bin/bash
# Issue 31 (for session 51; not yet run): the llama-1b step's GEMM problems that the H100 still serves from the
# heuristic (8 of 16 in session 50's step report: the CE's exp-stored ones and coda.optim's AdamW dW epilogues among
# them), tuned at the near level, only those (--source heuristic, 888c32c); the store comes back for --ship-from
# into autotune/shipped/h100_sxm.json (written problem by problem: a run cut by the limit returns what it tuned).
# A later call copies the store back to ~/.cache/coda/autotune.json and reruns: the tuned ones are then skipped.
cd "$(dirname "$0")/../.." || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
timeout ${TUNE_S:-400} python -m coda.autotune --model llama-1b --optimizer coda-adamw --source heuristic \
    --level near 2>&1 | grep -v "Warning\|warn(" | tail -30
echo "tune wall $(( $(date +%s) - S )) s"
cp ~/.cache/coda/autotune.json "$OUT/llama1b_heuristic_near_store_h100.json"
