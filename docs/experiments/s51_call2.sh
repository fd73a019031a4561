#!/bin/bash
# Session 51's second device call (issue 31), for the H100 (default) or, with GPU=h200, the H200 (not run: no
# device time). H100: call 1 tuned 7 of the 8 heuristic-served problems of the llama-1b step
# (docs/tune_h100/llama1b_heuristic_near_s51.json, seeded into the store here, so only the rest is tuned; six are
# K = 0 passes, which the default path now serves from the store / shipped file too); the CE's exp-stored forward
# failed every config (random unit inputs: exp of an N(0, K) logit overflows; inputs_for now scales them to an
# N(0, 1) accumulator). H200: h200.json's llama-1b entries are session 30's (the exp-stored CE, coda.optim's AdamW
# epilogues and the K = 0 passes came later): everything the heuristic serves is tuned. Then the store is shipped
# into the device's shipped file (back in $OUT: bring the store back to docs/tune_<gpu>/ and re-convert here with
# docs/experiments/reship.py) and the step report runs from an empty cache with that file (MODES: default all four).
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
GPU=${GPU:-h100}
SHIPPED=$([ "$GPU" = h100 ] && echo h100_sxm || echo "$GPU")
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
mkdir -p ~/.cache/coda "docs/tune_$GPU"
[ "$GPU" = h100 ] && cp docs/tune_h100/llama1b_heuristic_near_s51.json ~/.cache/coda/autotune.json
S=$(date +%s)
timeout ${TUNE_S:-150} python -m coda.autotune --model llama-1b --optimizer coda-adamw --source heuristic \
    --level near 2>&1 | grep -v "Warning\|warn(\|it/s\|shape/s" | tail -20
echo "tune wall $(( $(date +%s) - S )) s"
cp ~/.cache/coda/autotune.json "docs/tune_$GPU/llama1b_s51.json" && cp "docs/tune_$GPU/llama1b_s51.json" "$OUT/"
python -m coda.autotune --ship-from "docs/tune_$GPU/llama1b_s51.json" 2>&1 | tail -3
cp "autotune/shipped/$SHIPPED.json" "$OUT/"
rm -rf ~/.cache/coda  # the step report from an empty cache: kernels compiled, configs shipped or heuristic
S="--model llama-1b --optimizer coda-adamw --steps 10 --warmup ${WARMUP:-3} --profile-steps 1 --head-reps 2 --power"
(unset CODA_AUTOTUNE; timeout ${STEP_S:-330} python -m coda.bench.step $S \
    --modes ${MODES:-stock+compile,fused,fused+graph,fused+compile} --timeout 100 --out "$OUT/step" 2>&1 | \
    grep -E "^\| (stock|fused|mode)|rror|shipped" | tail -10)
