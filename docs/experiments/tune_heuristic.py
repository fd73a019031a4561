"""Which GEMM problems of the llama-1b step does the default chain serve by the heuristic (not the store, not the
shipped file), and tune those (issue 31: "the llama-1b shapes come from the shipped file").

Records one fused step (``coda.autotune.model.record_model_step``), prints every problem with what served it, then
tunes (``--level``, default near) the heuristic-served problems with a mainloop (K > 0) whose label contains one of
``--only`` (default: all), and copies the tuning store to ``--store-out`` for ``python -m coda.autotune --ship-from``.
Usage on the GPU: python docs/experiments/tune_heuristic.py [--only 128256] [--store-out $OUT/autotune.json]"""
import argparse
import os
import shutil

import coda.autotune as at
from coda.autotune import model

ap = argparse.ArgumentParser()
ap.add_argument("--only", default="")
ap.add_argument("--level", default="near")
ap.add_argument("--store-out", default=None)
ap.add_argument("--dry", action="store_true", help="only print the problems")
ap.add_argument("--optimizer", default="coda-adamw")
ap.add_argument("--force", default="", help="also tune problems whose label contains one of these (served by a "
                "shipped entry of the nearest shape, say)")
args = ap.parse_args()
problems = model.record_model_step("llama-1b", 2, 4096, "bfloat16", optimizer=args.optimizer)
for r in problems:
    print(f"{r.source:9s} {r.calls:3d}x  {r.label}  [{r.config.name}]", flush=True)
todo = [r for r in problems if r.prob.K > 0 and (
    (r.source == "heuristic" and (not args.only or any(o in r.label for o in args.only.split(","))))
    or any(f in r.label for f in filter(None, args.force.split(","))))]
print(f"{len(todo)} problems to tune: " + ", ".join(r.label for r in todo), flush=True)
if not args.dry:
    for r, _, status in model.tune_recorded(todo, level=args.level, retune=True):
        print(f"{r.label:50s} {status}", flush=True)
    if args.store_out:
        if os.path.exists(str(at.store.path)):
            shutil.copy(at.store.path, args.store_out)
