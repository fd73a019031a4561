#!/bin/bash
# Session 48, one call for whatever machine comes (H100 wanted: the README's table): the step report at the final
# code -- stock + compile, fused, fused + compile (fused + graph left out: it keeps the CE's softmax-gradient pass),
# CODA_AUTOTUNE unset, from an empty kernel cache (the fused modes' first step is the cold start) -- then the GPU
# tests of this session's QK-norm in the QKV GEMMs (issue 30) and the exp-stored CE.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
S="--model llama-1b --optimizer coda-adamw --steps 10 --profile-steps 1 --head-reps 2"
(unset CODA_AUTOTUNE; timeout ${STEP_S:-360} python -m coda.bench.step $S --modes ${MODES:-stock+compile,fused,fused+compile} \
    --timeout 115 --out "$OUT/step" 2>&1 | grep -E "first step|^\| (stock|fused|the|.coda)|rror|shipped|tuned|heuristic" | tail -12)
source docs/experiments/lib_device.sh
gpu_tests 5 ${TEST_S:-150} tests/test_rope_qknorm.py tests/test_attention_qknorm.py \
    "tests/test_fuse_families.py::test_family_fused_step_on_gpu[Qwen3]" \
    tests/test_attention_gpu.py::test_rope_grad_kernel_matches_the_reference tests/test_cross_entropy_exp.py
