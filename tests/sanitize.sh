#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over a reduced tier of the GPU suite (run on the H100; ~6 minutes).
#
#   tests/sanitize.sh              # both tools
#   tests/sanitize.sh memcheck     # one tool
#
# CODA_TEST_TIER=small shrinks tests/test_reliability_gpu.py (shapes, configs, repetitions); the existing GPU files
# have no tier, so a few small test ids are picked from them. Kernels run 10-100x slower under the sanitizer and
# the CuTe DSL compiles ~1-2 s per kernel (the on-disk compile cache, ~/.cache/coda or $CODA_CACHE_DIR, makes a
# second run faster). Each tool has a wall-clock budget (MEMCHECK_BUDGET / RACECHECK_BUDGET seconds); one line per
# tool is printed at the end, and the full logs are kept (their paths are in that line).
# Exit status: 0 if every tool ran its tests green with 0 sanitizer errors, else 1.
set -u
cd "$(dirname "$0")/.."

SANITIZER=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
PYTHON=${PYTHON:-python}
MEMCHECK_BUDGET=${MEMCHECK_BUDGET:-210}
RACECHECK_BUDGET=${RACECHECK_BUDGET:-150}
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/coda-sanitize.XXXXXX)}
mkdir -p "$LOGDIR"
TOOLS=("${@:-memcheck racecheck}")
TOOLS=(${TOOLS[*]})

export CODA_TEST_TIER=small
export CODA_AUTOTUNE=0                      # heuristic configs: no tuning runs under the sanitizer
export PYTORCH_NO_CUDA_MEMORY_CACHING=1     # one cudaMalloc per tensor: memcheck sees each tensor's real bounds

if [ ! -x "$SANITIZER" ]; then
  echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER=/path/to/compute-sanitizer)"; exit 1
fi

# memcheck: reliability (no cold-compile thread test: it only recompiles), plain GEMM edges, MN-major, batched /
# broadcast, every epilogue-operand kind, reductions, and the partial-buffer guard test.
MEMCHECK_TESTS=(
  "tests/test_reliability_gpu.py"
  "tests/test_gemm_gpu.py::test_shapes_default_config[dtype0-1-8-8]"
  "tests/test_gemm_gpu.py::test_shapes_default_config[dtype0-127-200-72]"
  "tests/test_gemm_gpu.py::test_shapes_default_config[dtype1-127-8-4104]"
  "tests/test_gemm_gpu.py::test_every_variant[dtype0-256x128_coop_c1x2_rm8]"
  "tests/test_gemm_gpu.py::test_mn_major_operands[128x128_pp_c1x2_rm8-mnmn]"
  "tests/test_gemm_gpu.py::test_batched_broadcast_weight"
  "tests/test_epilogue_hook_gpu.py::test_everything[2-128x128_pp_c1x1_rm8-test_everything]"
  "tests/test_epilogue_hook_gpu.py::test_partials_stay_in_bounds[128x256_coop_c2x1_rm8]"
)
MEMCHECK_K="not cold"  # the explicit ids below do not contain "cold"

# racecheck (shared-memory hazards): one cooperative cluster config, one ping-pong config, per-column reductions.
RACECHECK_TESTS=(
  "tests/test_reliability_gpu.py::test_bitwise_deterministic"
  "tests/test_gemm_gpu.py::test_shapes_default_config[dtype0-127-200-72]"
  "tests/test_epilogue_hook_gpu.py::test_three_reductions[128x256_coop_c2x1_rm8-True]"
)
RACECHECK_K=""

status=0
summaries=()
for tool in "${TOOLS[@]}"; do
  case "$tool" in
    memcheck) tests=("${MEMCHECK_TESTS[@]}"); kexpr="$MEMCHECK_K"; budget=$MEMCHECK_BUDGET ;;
    racecheck) tests=("${RACECHECK_TESTS[@]}"); kexpr="$RACECHECK_K"; budget=$RACECHECK_BUDGET ;;
    *) echo "sanitize: unknown tool $tool (memcheck or racecheck)"; exit 2 ;;
  esac
  log="$LOGDIR/$tool.log"
  start=$(date +%s)
  kargs=()
  [ -n "$kexpr" ] && kargs=(-k "$kexpr")
  timeout --signal=INT --kill-after=20 "$budget" \
    "$SANITIZER" --tool "$tool" --error-exitcode 86 --print-limit 50 \
    "$PYTHON" -m pytest -q -p no:cacheprovider -x "${kargs[@]}" "${tests[@]}" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  errs=$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$log" | awk '{s += $3} END {print (NR ? s : "n/a")}')
  hazards=$(grep -Eo 'RACECHECK SUMMARY: [0-9]+ hazard' "$log" | awk '{s += $3} END {print (NR ? s : "")}')
  pyline=$(grep -E '[0-9]+ (passed|failed|error|errors|skipped|xfailed|deselected)' "$log" | grep -v 'SUMMARY:' | tail -1 | sed 's/=//g;s/^ *//;s/ *$//')
  case $rc in
    124|130|137) verdict="TIMEOUT after ${budget}s" ;;
    0) verdict="ok" ;;
    86) verdict="SANITIZER ERRORS" ;;
    *) verdict="FAILED (rc $rc)" ;;
  esac
  # split memcheck's count: device memory-access errors vs host API errors (on the H100 all 34 reported errors were
  # CUDA_ERROR_INVALID_VALUE from cuGetProcAddress_v2: the cuda-python bindings probing driver entry points)
  mem=$(grep -cE 'Invalid (__global__|__shared__|__local__|global|shared)|out of bounds|[Mm]isaligned' "$log")
  api=$(grep -c 'Program hit CUDA_ERROR' "$log")
  line="$tool: $verdict; sanitizer errors: $errs (memory access: $mem, host API: $api)${hazards:+; racecheck hazards: $hazards}; pytest: ${pyline:-no summary}; ${secs}s; log $log"
  summaries+=("$line")
  [ "$rc" = 0 ] && [ "$errs" = 0 ] || status=1
done
for line in "${summaries[@]}"; do echo "$line"; done
exit $status
