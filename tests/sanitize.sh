#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over a reduced tier of the GPU suite (run on the H100; ~8-9 minutes).
#
#   tests/sanitize.sh              # both tools
#   tests/sanitize.sh memcheck     # one tool
#   tests/sanitize.sh --ids ...    # also list, per tool, the test ids that passed (or SANITIZE_IDS=1)
#
# CODA_TEST_TIER=small shrinks tests/test_reliability_gpu.py (shapes, configs, repetitions); the existing GPU files
# have no tier, so a few small test ids are picked from them. Kernels run 10-100x slower under the sanitizer and
# the CuTe DSL compiles ~1-2 s per kernel (the on-disk compile cache, ~/.cache/coda or $CODA_CACHE_DIR, makes a
# second run faster). Each tool has a wall-clock budget (MEMCHECK_BUDGET / RACECHECK_BUDGET seconds); one line per
# tool is printed at the end, and the full logs are kept (their paths are in that line). With --ids, the ids that
# passed under each tool are printed first (lines not starting with the tool's name); the summary lines stay last.
# Exit status: 0 if every tool ran its tests green with 0 sanitizer errors, else 1.
set -u
cd "$(dirname "$0")/.." || exit 1

SANITIZER=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
PYTHON=${PYTHON:-python}
# estimate on the H100 (cold compile cache): memcheck ~300 s, racecheck ~200 s; budget + 20 s < a 600 s command
MEMCHECK_BUDGET=${MEMCHECK_BUDGET:-480}
RACECHECK_BUDGET=${RACECHECK_BUDGET:-360}
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/coda-sanitize.XXXXXX)}
mkdir -p "$LOGDIR"
LIST_IDS=${SANITIZE_IDS:-0}
ARGS=()
for arg in "$@"; do
  case "$arg" in
    --ids) LIST_IDS=1 ;;
    *) ARGS+=("$arg") ;;
  esac
done
read -r -a TOOLS <<<"${ARGS[*]:-memcheck racecheck}"

export CODA_TEST_TIER=small
export CODA_AUTOTUNE=0                      # heuristic configs: no tuning runs under the sanitizer
export PYTORCH_NO_CUDA_MEMORY_CACHING=1     # one cudaMalloc per tensor: memcheck sees each tensor's real bounds

if [ ! -x "$SANITIZER" ]; then
  echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER=/path/to/compute-sanitizer)"; exit 1
fi

# memcheck: reliability (no cold-compile thread test: it only recompiles), plain GEMM edges, MN-major, batched /
# broadcast, every epilogue-operand kind, reductions, and the partial-buffer guard test; then each library epilogue
# and each op of coda.ops, forward and backward (one small shape, the heuristic config).
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
  # coda.ops.linear fwd + bwd: every operand kind, extra output, n/m/max/logsumexp reductions, operand gradients
  "tests/test_dsl_gpu.py::test_linear_forward_backward[False]"
  # coda.ops.linear over pairs epilogues: half pairs + reductions (operand grads), 2 -> 2 rotation backward
  "tests/test_dsl_gpu.py::test_linear_pairs_operand_gradients"
  "tests/test_dsl_gpu.py::test_linear_rotation_backward"
  # pairs-epilogue reductions (per row and per pair column), ragged + batched, 64x256 ping-pong 2x1 cluster
  "tests/test_dsl_gpu.py::test_pairs_reductions_fused[64x256_pp_c2x1_rm8]"
  # epilogues/rope.py + coda.ops.linear_rope fwd + bwd (K = 0 rotation GEMM, dX, dW), batched, V unrotated
  "tests/test_rope_gpu.py::test_linear_rope_fwd_bwd[lead1-520-64-6-4-None]"
  # epilogues/gated.py swiglu / geglu / geglu_erf + coda.ops.linear_swiglu / linear_geglu fwd + bwd (dX, dW); dacc
  # as a K = 0 launch on the saved pre-activation (True) or in the recompute GEMM (False)
  "tests/test_gated_gpu.py::test_ragged_fwd_bwd[True-lead0-520-776-swiglu]"
  "tests/test_gated_gpu.py::test_ragged_fwd_bwd[True-lead0-520-776-geglu_tanh]"
  "tests/test_gated_gpu.py::test_ragged_fwd_bwd[False-lead0-520-776-geglu_none]"
  # epilogues/cross_entropy.py + coda.ops.linear_cross_entropy: smoothing + z-loss (ce_*_smooth / _general, two
  # vocab chunks -> accumulate, V tail, ragged M), then plain ce_forward / ce_backward with dW on the kernel
  "tests/test_cross_entropy_gpu.py::test_matches_torch_2x_rule[0.1-0.001-mean-333-1003-256-512]"
  "tests/test_cross_entropy_gpu.py::test_huge_logits"
  # epilogues/rmsnorm.py (rmsnorm_scale, rmsnorm_dgrad, rmsnorm_dgrad_residual; fold_gamma and row_dot as K = 0
  # launches) + coda.ops.rmsnorm_linear fwd+bwd
  "tests/test_rmsnorm_linear_gpu.py::test_ragged_fwd_bwd[lead0-520-776-False]"
  "tests/test_rmsnorm_linear_gpu.py::test_ragged_fwd_bwd[lead0-520-776-True]"
  # coda.nn / coda.fuse: rmsnorm_swiglu (rms_swiglu, the first GEMM of coda.ops.mlp), RMSNormLinear, LM-head CE
  "tests/test_nn_gpu.py::test_fuse_matches_stock_on_cuda"
  # TileMN operands by TMA ring (bf16, fp32, add-to-output) and element-wise (unaligned rows), cooperative and
  # ping-pong; coda.ops.mlp fwd + bwd (residual_add, rms_radial_residual, fold_grads, pairs operand gradients;
  # dacc from the saved pre-activation and from the recompute)
  "tests/test_dsl_gpu.py::test_tile_operand_tma_and_element_paths[128x256_coop_c2x1_rm8]"
  "tests/test_dsl_gpu.py::test_tile_operand_tma_and_element_paths[128x128_pp_c1x1_rm8]"
  "tests/test_mlp_gpu.py::test_ragged_fwd_bwd[True-lead0-200-136-mlp]"
  "tests/test_mlp_gpu.py::test_ragged_fwd_bwd[False-lead0-200-136-mlp]"
  # in-kernel split-K (GemmConfig.splits): the workspace slots and flags, ragged, and the final split's epilogue
  # with staged operands, a reduction and a TileMN operand
  "tests/test_split_k_gpu.py::test_split_k_matches_float64[200-136-16384-128x256_coop_c1x1_rm8_sk16]"
  "tests/test_split_k_gpu.py::test_split_k_epilogues_run_once_on_the_summed_tile"
)
# not covered, no GPU test exists: epilogues/scale_bias.py (ScaleBias, ScaleBiasSumsq: only coda.bench and
# examples/quickstart.py run them, at 8192^3) and coda.ops.mlp's second GEMM (residual_add).
MEMCHECK_K="not cold"  # the explicit ids below do not contain "cold"

# racecheck (shared-memory hazards): one cooperative cluster config, one ping-pong config, per-column reductions;
# then one test per epilogue family, forward and backward.
RACECHECK_TESTS=(
  "tests/test_reliability_gpu.py::test_bitwise_deterministic"
  "tests/test_gemm_gpu.py::test_shapes_default_config[dtype0-127-200-72]"
  "tests/test_epilogue_hook_gpu.py::test_three_reductions[128x256_coop_c2x1_rm8-True]"
  # 2 -> 2 pairs: rope (coda.ops.linear_rope, ragged M)
  "tests/test_rope_gpu.py::test_linear_rope_fwd_bwd[lead0-264-128-4-None-None]"
  # half pairs: swiglu (coda.ops.linear_swiglu, M = 999), its dacc a K = 0 launch on the saved pre-activation
  "tests/test_gated_gpu.py::test_ragged_fwd_bwd[True-lead2-264-136-swiglu]"
  # logsumexp reduction, no main output: cross entropy (coda.ops.linear_cross_entropy)
  "tests/test_cross_entropy_gpu.py::test_huge_logits"
  # axis-m (per pair column) and per-row reductions in a pairs epilogue, fwd + 2 -> 2 bwd (coda.ops.linear)
  "tests/test_dsl_gpu.py::test_linear_pairs_operand_gradients"
  # TileMN TMA ring (mbarrier-guarded smem buffers reused every second sub-tile), cooperative and ping-pong
  "tests/test_dsl_gpu.py::test_tile_operand_tma_and_element_paths[128x256_coop_c2x1_rm8]"
  "tests/test_dsl_gpu.py::test_tile_operand_tma_and_element_paths[64x256_pp_c1x1_rm8]"
)
RACECHECK_K=""

status=0
summaries=()
idlists=()
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
    "$PYTHON" -m pytest -q -p no:cacheprovider -x -rap "${kargs[@]}" "${tests[@]}" >"$log" 2>&1
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
  if [ "$LIST_IDS" = 1 ]; then  # pytest -rap: one 'PASSED <id>' line per passed test in the short summary
    passed=$(grep -E '^PASSED ' "$log" | sed 's/^PASSED /  /')
    n=$(grep -cE '^PASSED ' "$log")
    block="passed under $tool ($n):"
    [ -n "$passed" ] && block+=$'\n'"$passed"
    idlists+=("$block")
  fi
  # racecheck prints no ERROR SUMMARY (errs n/a), only its hazard count
  { [ "$rc" = 0 ] && { [ "$errs" = 0 ] || { [ "$errs" = n/a ] && [ "$hazards" = 0 ]; }; }; } || status=1
done
for block in "${idlists[@]}"; do echo "$block"; done
for line in "${summaries[@]}"; do echo "$line"; done
exit $status
