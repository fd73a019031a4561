# session 39: the step report at the session's final code (H100, CODA_AUTOTUNE unset: the shipped configs), all four
# modes, a second instance after call 1's
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
CODA_COMMIT=$CODA_COMMIT timeout 400 python -m coda.bench.step --model llama-1b --modes stock+compile,fused,fused+graph,fused+compile --optimizer coda-adamw --timeout 150 --out $OUT/step 2>&1 | grep -E "^\| (stock|fused)" | tail -4
