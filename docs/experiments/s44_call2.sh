#!/bin/bash
# Session 44, call 2 (H100): issue acceptance runs at the final code.
#  - issue 28: LM head + cross entropy fwd+bwd, CODA fast / lean vs the three cuBLAS GEMMs, torch.compile and
#    Liger 0.8.5's fused linear cross entropy, one process (carry .whl with the liger wheel);
#  - issue 30: examples/llama_train.py --grad-check --compile --compile-fused (every gradient vs float64);
#  - the GPU tests of 2fae1d8 (dispatcher QKV) and the eager entry.
cd "$(dirname "$0")/../.." || exit 1
export CODA_AUTOTUNE=0
if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 220 python -m coda.bench.ce --H 2048,4096 2>&1 | grep -v Warn | tail -24
timeout 200 python examples/llama_train.py --device cuda --grad-check --compile --compile-fused 2>&1 | grep -v Warn | tail -40
timeout 150 python -m pytest -q tests/test_attention_gpu.py tests/test_eager_entry.py 2>&1 | tail -4
