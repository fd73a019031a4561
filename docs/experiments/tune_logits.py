"""Tune the fast cross entropy's logits GEMM as the llama-1b step runs it under coda.optim (one chunk of all
8192 tokens: 8192 x 128256 x 2048, epilogue ce_forward_logits(bf16)), near level, store the winner and copy the
tuning store to argv[1] (for ``python -m coda.autotune --ship-from``). Usage on the GPU:
python docs/experiments/tune_logits.py $OUT/autotune.json"""
import os
import shutil
import sys

import torch

import coda.autotune as at
from coda.epilogues.cross_entropy import ce_forward_logits

x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
w = torch.randn(128256, 2048, device="cuda", dtype=torch.bfloat16)
res = at.tune(x, w, epilogue=ce_forward_logits(torch.bfloat16), level="near", progress=False)  # (stored)
print(f"best {res.best.name} {res.best_ms:.3f} ms; heuristic {res.default.name} {res.default_ms:.3f} ms")
for row in res.rows:
    print(row)
if len(sys.argv) > 1 and os.path.exists(str(at.store.path)):
    shutil.copy(at.store.path, sys.argv[1])
