#!/bin/bash
# session 42, call 4 (H200): cProfile of the first compiled step, attention fused under compile, 6 layers
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
timeout 200 python docs/experiments/s42_recompiles.py --attention fused --steps 1 --layers 6 --hidden 2048 --inter 8192 \
    --heads 32 --kv-heads 8 --seq 4096 --cprofile --log-compiles > $OUT/prof.txt 2>&1
echo rc=$?
grep -E "^step|function calls" $OUT/prof.txt
grep -E "^\s+[0-9]" $OUT/prof.txt | grep -v -E "_dynamo/(symbolic_convert|variables)" | sed -e 's#/opt/torch/.venv/lib/python3.12/site-packages/##' | cut -c1-170 | head -70
