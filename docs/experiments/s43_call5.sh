#!/bin/bash
# Session 43, call 5 (H200): the top copy kernels of the compiled fused step and the ops that launch them (2 layers)
cd "$(dirname "$0")/../.." || exit 1
export CODA_AUTOTUNE=0
timeout 150 python docs/experiments/s43_copies.py --layers 2 2>&1 | grep -v Warn | tail -16
