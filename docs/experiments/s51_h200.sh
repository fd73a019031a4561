#!/bin/bash
# Session 51 on an H200 (issue 31): the llama-1b step's problems that h200.json does not serve (its llama-1b store is
# session 30's: the exp-stored CE, coda.optim's AdamW epilogues and the K = 0 passes came later), tuned at the near
# level; the store shipped into the device's h200.json (back in $OUT); then stock + compile and fused from an empty
# cache with that file.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
S=$(date +%s)
timeout ${TUNE_S:-260} python -m coda.autotune --model llama-1b --optimizer coda-adamw --source heuristic \
    --level near 2>&1 | grep -v "Warning\|warn(\|it/s\|shape/s" | tail -22
echo "tune wall $(( $(date +%s) - S )) s"
mkdir -p docs/tune_h200 && cp ~/.cache/coda/autotune.json docs/tune_h200/llama1b_s51.json && cp docs/tune_h200/llama1b_s51.json "$OUT/"
python -m coda.autotune --ship-from docs/tune_h200/llama1b_s51.json 2>&1 | tail -2
cp autotune/shipped/h200.json "$OUT/h200.json"
rm -rf ~/.cache/coda
S="--model llama-1b --optimizer coda-adamw --steps 10 --warmup 3 --profile-steps 1 --head-reps 0 --power"
(unset CODA_AUTOTUNE; timeout ${STEP_S:-200} python -m coda.bench.step $S --modes ${MODES:-stock+compile,fused} \
    --timeout 100 --out "$OUT/step" 2>&1 | grep -E "^\| (stock|fused|mode)|rror|shipped" | tail -6)
