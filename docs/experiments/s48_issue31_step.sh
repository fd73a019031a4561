#!/bin/bash
# Issue 31's acceptance on the H100: the fused llama-1b step with the shipped configs (empty cache, CODA_AUTOTUNE
# unset) against the same step after every one of its GEMMs is tuned on this machine (--level near --retune: the
# shipped file's own level), alternated on one machine: "within 3 % of the tokens/s of a fully tuned run".
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
unset CODA_AUTOTUNE
S="--model llama-1b --optimizer coda-adamw --steps 8 --profile-steps 1 --head-reps 0 --modes fused --timeout 90"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
export CODA_CACHE_DIR=/tmp/shipped && timeout 120 python -m coda.bench.step $S --out "$OUT/shipped_1" 2>&1 | \
    grep -E "^\| fused|first step|shipped|rror" | tail -4
export CODA_CACHE_DIR=/tmp/tuned && timeout ${TUNE_S:-300} python -m coda.autotune --model llama-1b --level near \
    --retune 2>&1 | tr '\r' '\n' | grep -E "tuned .* shapes|rror" | tail -3
mkdir -p "$OUT/tuned" && cp /tmp/tuned/autotune.json "$OUT/tuned/"
for r in 1 2; do
  CODA_CACHE_DIR=/tmp/tuned timeout 100 python -m coda.bench.step $S --out "$OUT/tuned_$r" 2>&1 | grep -E "^\| fused|tuned|rror" | tail -2
  CODA_CACHE_DIR=/tmp/shipped timeout 100 python -m coda.bench.step $S --out "$OUT/shipped_$((r + 1))" 2>&1 | grep -E "^\| fused|shipped|rror" | tail -2
done
