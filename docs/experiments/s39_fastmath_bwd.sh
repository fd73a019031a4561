# session 39: the fastmath flag's derived backward programs on the GPU (tests/test_dsl_gpu.py, one new test)
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
CODA_AUTOTUNE=0 timeout 140 python -m pytest -q tests/test_dsl_gpu.py -k "derived or fastmath_division" -p no:cacheprovider 2>&1 | tail -3
