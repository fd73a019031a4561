#!/bin/bash
# session 42, call 3 (H200): where the first compiled step with the attention fused under compile spends its time:
# 4 layers from a cold kernel cache, then 8 layers (kernels cached), every kernel load / compile logged, every
# thread's stack dumped at 100 s
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
for L in 4 8; do
  echo "== layers $L"
  timeout 150 python docs/experiments/s42_recompiles.py --attention fused --steps 2 --layers $L --hidden 2048 --inter 8192 \
    --heads 32 --kv-heads 8 --seq 4096 --log-compiles --stacks-after 100 2>&1 | grep -v -i warn | cut -c1-200 | tail -60
done
