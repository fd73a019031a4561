#!/bin/bash
# Written for session 48 (not run there; session 49: after s49_call1.sh): session 47's CE follow-up
# (docs/experiments/s47_exp_sum.patch: the
# exp-stored logits epilogue sums e^z instead of an online logsumexp -- 0 spills, 1912 vs 2768 SASS -- and x's rows
# for dW's GEMM scaled by one K = 0 pass) applied to the device copy: its GPU tests, then the fused step with the
# patch vs without (.ab_old/ = the files before it), ROUNDS alternated rounds. If it wins, apply the patch in the
# repository (git apply) and commit with these numbers; then the four-mode report: CODA_COMMIT=... bash
# docs/experiments/s44_call1.sh.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
rm -rf .ab_old && mkdir -p .ab_old/ops .ab_old/epilogues
cp ops/cross_entropy.py ops/cross_entropy_fast.py .ab_old/ops/ && cp epilogues/cross_entropy.py .ab_old/epilogues/
patch -p1 < docs/experiments/s47_exp_sum.patch || exit 1
source docs/experiments/lib_device.sh
gpu_tests 4 ${TEST_S:-150} tests/test_cross_entropy_exp.py tests/test_cross_entropy_gpu.py tests/test_rope_qknorm.py \
    tests/test_attention_gpu.py::test_rope_grad_kernel_matches_the_reference tests/test_attention_qknorm.py \
    "tests/test_fuse_families.py::test_family_fused_step_on_gpu[Qwen3]"
ab_step ${ROUNDS:-2} ${AB_S:-300}
