"""Where the fused step's small torch ops come from, on the CPU: one training step of a scaled-down llama preset
(coda.fuse, coda.optim.AdamW, eager, bf16 on the CPU: CODA's kernels run their reference path) under a
TorchDispatchMode that records every aten op with the innermost frames of its Python stack in this repository. Ops
issued inside a kernel's CPU reference (coda/reference.py, coda/_eval.py, a ``*_reference*`` function) are dropped:
on the GPU those are CODA kernels. What is left is what the GPU step launches as torch kernels (plus the stock
parts: attention, the embedding lookup). Usage: python docs/experiments/small_ops_cpu.py [--top 40]"""
import argparse
import traceback
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coda.bench.step_ops import one_step

ap = argparse.ArgumentParser()
ap.add_argument("--top", type=int, default=40)
args = ap.parse_args()
import coda.bench.step as S  # noqa: E402
S.PRESETS["tiny"] = dict(hidden=256, intermediate=512, layers=2, heads=8, kv_heads=2, vocab=1024)
step = one_step("tiny", 2, 2, 64, device="cpu", optimizer="coda-adamw")
step()
SKIP = ("reference", "/_eval.py", "dispatch")
rows = defaultdict(int)


class Log(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/work/" in f.filename or "/coda" in f.filename]
        if not any(s in f.filename or s in f.name for f in frames for s in SKIP):
            mine = [f for f in frames if "site-packages/torch" not in f.filename]
            where = " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in mine[::-1][:3])
            rows[(str(func), where)] += 1
        return func(*args, **(kwargs or {}))


with Log():
    step()
for (op, where), n in sorted(rows.items(), key=lambda kv: kv[0][1])[:args.top * 10]:
    if not any(k in op for k in ("view", "detach", "t.default", "alias", "_unsafe_view", "as_strided", "expand",
                                 "slice", "select", "empty", "transpose", "reshape", "unsqueeze", "squeeze")):
        print(f"x{n:3d} {op:40s} {where}")
