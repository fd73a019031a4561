#!/bin/bash
# Session 46, call 5 (H100): (1) the epilogue warps' outputs bit for bit, new vs .ab_old/ (s46_ewg_bits.py);
# (2) issue 31: tune the fused training steps of MODELS at the near level, one tuning store per model in $OUT.
cd "$(dirname "$0")/../.." || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
CODA_AUTOTUNE=0 timeout 60 python -m coda.bench.ab_files .ab_old 1 -- python docs/experiments/s46_ewg_bits.py 2>&1 | \
    grep -E "^=== round|^BITS|rror" | tail -8
for m in ${MODELS:-llama-70b-tp8-2l:220 qwen2.5-7b-2l:270}; do
  export CODA_CACHE_DIR=/tmp/tune-${m%%:*}
  timeout ${m##*:} python -m coda.autotune --model ${m%%:*} --level near 2>&1 | grep -v -i "warn" | tr '\r' '\n' | \
      grep -E "tuned|^[0-9]+x|rror|results" | tail -24
  mkdir -p "$OUT/${m%%:*}" && cp $CODA_CACHE_DIR/autotune.json "$OUT/${m%%:*}/" 2>/dev/null
done
