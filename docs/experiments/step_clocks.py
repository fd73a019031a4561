"""Is the timed step slower than its profiled replay because the clocks drop under sustained load?

Runs the llama-1b fused step as one CUDA graph (coda.bench.step_ops.one_step(graph=True)); times 10 replays back
to back (CUDA events per replay) and 5 replays each after a 2 s pause, while `nvidia-smi` samples the SM clock and
the power draw every 100 ms. Usage on the GPU: python docs/experiments/step_clocks.py [--stock --compile]."""
import argparse
import subprocess
import time

import torch

from coda.bench.gemm import event_times
from coda.bench.step_ops import one_step

ap = argparse.ArgumentParser()
ap.add_argument("--stock", action="store_true")
ap.add_argument("--compile", action="store_true")
ap.add_argument("--n", type=int, default=10)
args = ap.parse_args()
graph = not args.compile
step = one_step("llama-1b", None, 2, 4096, stock=args.stock, compile=args.compile,
                optimizer="adamw-fused" if args.stock else "coda-adamw", graph=graph)
for _ in range(3):
    step()
torch.cuda.synchronize()
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader",
                        "-lms", "100"], stdout=subprocess.PIPE, text=True)


def timed(n, pause):
    return [round(t, 2) for t in event_times(step, count=n, pause=pause)]


t0 = time.time()
paused = timed(5, 2.0)
t1 = time.time()
sustained = timed(args.n, 0)
t2 = time.time()
smi.terminate()
samples = smi.stdout.read().strip().splitlines()
print("mode", "stock" if args.stock else "fused", "+compile" if args.compile else "+graph")
print("after a 2 s pause:", paused)
print("back to back:", sustained)
print(f"nvidia-smi samples (clock MHz, W, C), {len(samples)} over {t2 - t0:.1f} s; pauses end at {t1 - t0:.1f} s:")
print(" | ".join(s.replace(" MHz", "").replace(" W", "") for s in samples[::3]))
