#!/bin/bash
# Shared steps of the device-call scripts (source it from the repository root):
#   gpu_tests JOBS SECONDS FILE...  the GPU test files, JOBS at a time, SECONDS per file (tests/gpu_suite.sh, logs in
#                                   $OUT/suite), then any failure lines;
#   ab_step ROUNDS SECONDS          the fused llama-1b step, the tree vs the files in .ab_old/, ROUNDS alternated
#                                   rounds on this machine (coda.bench.ab_files), CODA_AUTOTUNE unset; AB_STEPS
#                                   timed steps a side (default 8);
#   tune_model SECONDS STORE ARG... llama-1b's model tuning with ARG..., its store copied to $OUT/STORE.
gpu_tests() {
  local jobs=$1 secs=$2; shift 2
  CODA_AUTOTUNE=0 JOBS=$jobs PER_FILE_TIMEOUT=$secs timeout $((secs + 5)) bash tests/gpu_suite.sh "$OUT/suite" "$@" \
      2>&1 | tail -$(($# + 2))
  grep -h -E "^(FAILED|ERROR)|Error|assert" "$OUT"/suite/*.log 2>/dev/null | head -12
}

ab_step() {
  local S="--model llama-1b --optimizer coda-adamw --steps ${AB_STEPS:-8} --profile-steps 1 --head-reps 0 --modes fused --timeout 80"
  (unset CODA_AUTOTUNE; timeout "$2" python -m coda.bench.ab_files .ab_old "$1" -- python -m coda.bench.step $S \
      --out "$OUT/ab_{ab}_{round}" 2>&1 | grep -E "^=== round|^\| fused|rror" | tail -$((4 * $1 + 2)))
}

# tune_model SECONDS STORE ARG...  python -m coda.autotune --model llama-1b --optimizer coda-adamw ARG... (the
#                                  output's tail, the wall time), then the tuning store copied to $OUT/STORE
tune_model() {
  local secs=$1 store=$2 S
  shift 2
  mkdir -p ~/.cache/coda
  S=$(date +%s)
  timeout "$secs" python -m coda.autotune --model llama-1b --optimizer coda-adamw "$@" 2>&1 | \
      grep -v "Warning\|warn(\|it/s\|shape/s" | tail -14
  echo "tune wall $(( $(date +%s) - S )) s"
  cp ~/.cache/coda/autotune.json "$OUT/$store" 2>/dev/null
}
