# session 39: after shipping the llama-8b-4l tuning (autotune/shipped/h100_sxm.json): the op-level rows whose GEMMs
# that step runs (mlp, cross entropy), CODA_AUTOTUNE unset, next to s39_bench.sh's run; the embedding GPU tests
# (int32 sort keys)
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
timeout 100 python -m pytest -q tests/test_embedding_gpu.py -p no:cacheprovider 2>&1 | tail -1
O=$OUT/bench
timeout 300 python -m coda.bench --ops mlp,linear_cross_entropy --out $O 2>&1 | grep -vi warn | grep -E "autotune|wrote .*md"
grep -A8 "^## Summary" $O/report.md | tail -5
