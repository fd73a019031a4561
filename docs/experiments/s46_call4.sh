#!/bin/bash
# Session 46, call 4 (H100): (1) the epilogue warps' outputs bit for bit, new vs .ab_old/ (s46_ewg_bits.py);
# (2) issue 31: tune every GEMM of a preset's fused training step at the near level (python -m coda.autotune
# --model PRESET --level near, coda.optim's step), then copy the tuning store to $OUT for `--ship-from`.
# MODEL (default qwen3-8b-2l), TUNE_S (default 460 s).
cd "$(dirname "$0")/../.." || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
CODA_AUTOTUNE=0 timeout 90 python -m coda.bench.ab_files .ab_old 1 -- python docs/experiments/s46_ewg_bits.py 2>&1 | \
    grep -E "^=== round|^BITS|rror" | tail -8
export CODA_CACHE_DIR=${CODA_CACHE_DIR:-/tmp/coda-tune-cache}
timeout ${TUNE_S:-460} python -m coda.autotune --model ${MODEL:-qwen3-8b-2l} --level near 2>&1 | \
    grep -v -i "warn" | tail -30
mkdir -p "$OUT/tune" && cp "$CODA_CACHE_DIR"/*.json "$OUT/tune/" 2>/dev/null; ls -la "$OUT/tune"
