#!/bin/bash
# needs `git apply docs/experiments/side_job.patch` (session 40: the side job is not in the library)
# session 40: the side job (logits GEMM + previous chunk's softmax gradient), correctness and timing per variant
export CODA_AUTOTUNE=0
timeout 200 python docs/experiments/side_job.py --rows 2048 --variants "4,72,0;2,56,0;2,40,0;4,72,1" 2>&1 | grep -v Warn
timeout 150 python docs/experiments/side_job.py --rows 2048 --graph --variants "4,72,0" 2>&1 | grep -v Warn | tail -5
