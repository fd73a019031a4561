#!/bin/bash
# session 40: GPU checks of session 39's review mends (CE reduction='none' fast backward without the scale-by-one
# pass, coda.autodiff.derived carrying fastmath) at the session's final library code
timeout 200 python -m pytest -q tests/test_cross_entropy_gpu.py tests/test_dsl_gpu.py -k "none or softcap or fastmath" 2>&1 | tail -3
