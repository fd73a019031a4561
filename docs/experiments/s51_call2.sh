#!/bin/bash
# Session 51's second device call (H100, issue 31): call 1 tuned 7 of the 8 heuristic-served problems of the
# llama-1b step (docs/tune_h100/llama1b_heuristic_near_s51.json; six are K = 0 passes, which the default path now
# serves from the store / shipped file too); the CE's exp-stored forward failed every config (random unit inputs:
# exp of an N(0, K) logit overflows; inputs_for now scales them to an N(0, 1) accumulator). Here: that problem
# again (the store copied back, so only it is left), then the store shipped into autotune/shipped/h100_sxm.json
# (the device's copy; it comes back in $OUT) and the four-mode step report from an empty cache with that file.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
mkdir -p ~/.cache/coda && cp docs/tune_h100/llama1b_heuristic_near_s51.json ~/.cache/coda/autotune.json
S=$(date +%s)
timeout ${TUNE_S:-150} python -m coda.autotune --model llama-1b --optimizer coda-adamw --source heuristic \
    --level near 2>&1 | grep -v "Warning\|warn(\|it/s\|shape/s" | tail -12
echo "tune wall $(( $(date +%s) - S )) s"
cp ~/.cache/coda/autotune.json docs/tune_h100/llama1b_s51.json && cp docs/tune_h100/llama1b_s51.json "$OUT/"
python -m coda.autotune --ship-from docs/tune_h100/llama1b_s51.json 2>&1 | tail -3
cp autotune/shipped/h100_sxm.json "$OUT/h100_sxm.json"
rm -rf ~/.cache/coda  # the step report from an empty cache: kernels compiled, configs shipped or heuristic
S="--model llama-1b --optimizer coda-adamw --steps 10 --warmup ${WARMUP:-3} --profile-steps 1 --head-reps 2 --power"
(unset CODA_AUTOTUNE; timeout ${STEP_S:-330} python -m coda.bench.step $S \
    --modes ${MODES:-stock+compile,fused,fused+graph,fused+compile} --timeout 100 --out "$OUT/step" 2>&1 | \
    grep -E "^\| (stock|fused|mode)|rror|shipped" | tail -10)
