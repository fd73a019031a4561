# session 39 call 1 (H100): the GPU tests pending since session 38 (CE fast mode reduction='none'; the embedding
# update with fast division / square root), then the step report with CODA_AUTOTUNE unset (the shipped configs).
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
CODA_AUTOTUNE=0 timeout 200 python -m pytest -q tests/test_cross_entropy_gpu.py tests/test_embedding_gpu.py -p no:cacheprovider 2>&1 | tail -4
CODA_COMMIT=$CODA_COMMIT timeout 330 python -m coda.bench.step --model llama-1b --modes stock+compile,fused,fused+graph --optimizer coda-adamw --timeout 150 --out $OUT/step 2>&1 | grep -E "^\| (stock|fused)" | tail -3
