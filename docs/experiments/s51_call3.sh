#!/bin/bash
# Session 51's third device call (H100): issue 28's side by side at the current code (the exp-stored fast mode of
# session 47 has not met Liger since session 46's run: carry .whl with liger-kernel 0.8.5) and the op-level report
# (`python -m coda.bench`, not run since session 48) -- CODA_AUTOTUNE unset: shipped configs or the heuristic.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
(unset CODA_AUTOTUNE; timeout ${CE_S:-240} python -m coda.bench.ce --H 2048,4096 2>&1 | grep -v Warn | tee "$OUT/ce.txt" | tail -24)
(unset CODA_AUTOTUNE; timeout ${OPS_S:-300} python -m coda.bench --ops ${OPS:-gemm.fwd,mlp.fwd,mlp.fwd+bwd,linear_swiglu.fwd} \
    --out "$OUT/ops" 2>&1 | grep -v Warn | tail -30)
