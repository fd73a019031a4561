#!/bin/bash
# Session 49's second device call (H100): the GPU tests of Qwen2's q/k/v biases in the QKV epilogues and the
# backward pass (tests/test_attention_bias.py, the fused tiny Qwen2 step), examples/llama_train.py --grad-check
# --compile (issue 30's acceptance), the rope_grad kernels' times (plain and bias variants); then session 47's CE
# follow-up (docs/experiments/s49_exp_sum.patch: the s47 patch rebased on session 48's review -- the exp-stored
# logits epilogue sums e^z instead of an online logsumexp, 0 spills, 1912 vs 2768 SASS; x's rows for dW's GEMM
# scaled by one K = 0 pass) applied to the device copy: its GPU tests and the fused step with the patch vs without
# (.ab_old/ = the files before it), ROUNDS alternated rounds.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
source docs/experiments/lib_device.sh
gpu_tests 4 ${TEST_S:-150} tests/test_attention_bias.py "tests/test_fuse_families.py::test_family_fused_step_on_gpu[Qwen2]"
(unset CODA_AUTOTUNE; timeout ${GC_S:-150} python examples/llama_train.py --device cuda --grad-check --compile \
    --compile-fused 2>&1 | tail -${GC_LINES:-40})
CODA_AUTOTUNE=0 timeout 60 python -m coda.bench.rope_grad 2>&1 | grep -E "^rope_grad|rror" | head -3
rm -rf .ab_old && mkdir -p .ab_old/ops .ab_old/epilogues
cp ops/cross_entropy.py ops/cross_entropy_fast.py .ab_old/ops/ && cp epilogues/cross_entropy.py .ab_old/epilogues/
patch -p1 < docs/experiments/s49_exp_sum.patch || exit 1
gpu_tests 2 ${CE_TEST_S:-100} tests/test_cross_entropy_exp.py tests/test_cross_entropy_gpu.py
ab_step ${ROUNDS:-1} ${AB_S:-170}
