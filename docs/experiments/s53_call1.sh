#!/bin/bash
# Session 53's device call 1 (H100, <= 10 min): the in-kernel split-K (533b548, GemmConfig(splits=S); built and
# CPU-tested only) and the prefill recorder (4b88f74). 1. its GPU tests (float64 2x rule, NaN-poisoned outputs,
# epilogues run once on the summed tile, determinism and flag reset, CUDA-graph replay) and the prefill test;
# 2. issue 29's few-tile long-K shapes side by side (python -m coda.bench.split_k: cuBLAS, default, fixed configs,
# the host split, the in-kernel splits sk{s} / sk{s}/128). If the tests hang (a flag never raised): the timeout
# kills them; rerun one test with compute-sanitizer --tool racecheck / synccheck.
cd "$(dirname "$0")/../.." || exit 1
export CODA_COMMIT=${CODA_COMMIT:?set CODA_COMMIT: the device copy of .git is stale}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
S=$(date +%s)
timeout ${TEST_S:-240} python -m pytest -q -x tests/test_split_k_gpu.py tests/test_autotune.py -k "split or prefill" \
    -p no:cacheprovider 2>&1 | tail -15
echo "tests wall $(( $(date +%s) - S )) s"
S=$(date +%s)
timeout ${BENCH_S:-330} python -m coda.bench.split_k --layout fwd --splits 2,4,8,16 2>&1 | grep -v Warn | \
    tee "$OUT/split_k_fwd.txt" | tail -11
echo "bench wall $(( $(date +%s) - S )) s"
