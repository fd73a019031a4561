#!/bin/bash
# session 42, call 1 (H200): the GPU tests of the compiled in-backward update (LM head, attention twins: never
# GPU-run), then a compiled fused 2-layer llama-1b-width model with the attention fused under compile, per step
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 240 python -m pytest -q -x tests/test_optim_gpu.py tests/test_attention_gpu.py --durations=5 2>&1 | tail -12
for a in fused inductor; do
  echo "== attention $a"
  timeout 130 python docs/experiments/s42_recompiles.py --attention $a --steps 5 --layers 2 --hidden 2048 --inter 8192 \
    --heads 32 --kv-heads 8 --seq 4096 --stacks-after 100 2>&1 | grep -v -i warn | tail -40
done
