"""Where the fused step's small torch kernels come from: one profiled llama-1b step (coda.fuse, coda.optim.AdamW,
eager), every kernel that is neither CODA's (CuTeDSL) nor cuDNN's nor cuBLAS's grouped by its name and the innermost
frames of its launching Python stack in this repository. Usage on the GPU:
python docs/experiments/small_kernels.py [--layers 2]"""
import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from coda.bench.step_ops import one_step

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=2)
args = ap.parse_args()
step = one_step("llama-1b", args.layers, 2, 4096, optimizer="coda-adamw")
for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
    step()
    torch.cuda.synchronize()
BIG = ("cutlass", "cudnn", "nvjet", "sm90_xmma", "gemvx", "Memcpy", "Memset")
rows = defaultdict(lambda: [0, 0.0])
for ev in prof.events():
    for k in ev.kernels:
        if any(b in k.name for b in BIG):
            continue
        frames = [f for f in (ev.stack or []) if ("/coda/" in f or "/ops/" in f or "/examples/" in f
                                                   or "/epilogues/" in f) and "profiler" not in f]
        key = (k.name[:70], ev.name, " < ".join(f.split("/")[-1] for f in frames[:3]))
        rows[key][0] += 1
        rows[key][1] += k.duration / 1e3
print(f"{torch.cuda.get_device_name()}: llama-1b with {args.layers} layers, fused, one eager step; small kernels (ms)")
for (name, op, where), (n, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:40]:
    print(f"{ms:7.3f} x{n:3d} {name} | {op} | {where}")
