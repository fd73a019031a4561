#!/bin/bash
# Session 53's device call 2 (H100, <= 9 min): retune the llama-1b problems whose shipped entries are oldest and
# furthest above the FLOPs at 700 TFLOP/s (shipped file, session 53's table in docs/NOTES.md): the SwiGLU backward
# on da (64 x 256 ping-pong from session 25: 0.547 ms, 1.39x; session 38's decomposition timed 128 x 256 cooperative
# static at 0.519), the norm-backward dX GEMMs (rmsnorm_dgrad(_residual), 1.22-1.31x), the O projection's
# residual + sum of squares (1.25x), the SwiGLU forward (1.07x). Quick level: every tile / schedule / cluster, and
# the split-K variants where the tiles are few. ONLY= picks a subset (comma-separated label substrings); the store
# comes back as $OUT/llama1b_retune_s53.json (ship it with docs/experiments/reship.py after committing it).
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
tune_model "${TUNE_S:-500}" llama1b_retune_s53.json --retune --level quick \
    --only "${ONLY:-rms_swiglu_bwd,rmsnorm_dgrad,residual_add_sumsq_bfloat16_gamma,rms_swiglu_preact}"
