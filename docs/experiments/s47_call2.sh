#!/bin/bash
# Issue 31, the tuning session 46 left unfinished (H100): resume each model's near-level tuning from its committed
# store (problems already tuned are kept; only the missing ones are tuned), then copy the stores to $OUT for
# `python -m coda.autotune --ship-from` (and the converter test's source list). MODELS as model:store:seconds.
cd "$(dirname "$0")/../.." || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for m in ${MODELS:-llama-70b-tp8-2l:docs/tune_h100/llama70b_tp8_2l_near_s46.json:250 \
                    qwen2.5-7b-2l:docs/tune_h100/qwen25_7b_2l_near_s46.json:250}; do
  IFS=: read -r model store secs <<< "$m"
  export CODA_CACHE_DIR=/tmp/tune-$model && mkdir -p "$CODA_CACHE_DIR" && cp "$store" "$CODA_CACHE_DIR/autotune.json"
  timeout "$secs" python -m coda.autotune --model "$model" --level near 2>&1 | tr '\r' '\n' | \
      grep -E "tuned .* shapes|^[0-9]+x[0-9]+x|rror" | tail -20
  mkdir -p "$OUT/$model" && cp "$CODA_CACHE_DIR/autotune.json" "$OUT/$model/"
done
