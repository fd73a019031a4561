"""CPU: SASS instructions an epilogue-warp lane spends per accumulator element on the epilogues of the shipped
entries that run in the epilogue warps (epi_wg: coda.optim's dW + update GEMMs and others). Their loop is not
unrolled over a tile, so the kernel's SASS with the epilogue minus with the identity (same config) is one loop
body's worth: divided by the elements a lane handles per pass of the loop (ewg_unroll rows x VEC columns).
Usage: CUTE_DSL_ARCH=sm_90a PYTHONPATH=<tree>:<tree>/tests python docs/experiments/s45_ewg_sass.py [--ops] [--file F]"""
import argparse
import json

from coda.autotune import ship, space
from coda.check import compile_variant
from coda.kernels.epilogue import Epilogue
from coda.kernels.epilogue_wg import VEC, ewg_unroll
from test_first_use_tuning import _library_epilogues_by_id

SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
ap = argparse.ArgumentParser()
ap.add_argument("--file", default="h100_sxm.json")
ap.add_argument("--ops", action="store_true")
args = ap.parse_args()
doc = json.loads(open(ship.SHIPPED_DIR / args.file).read())
library = _library_epilogues_by_id()
seen = set()
for k, e in sorted(doc["entries"].items(), key=lambda kv: kv[1]["name"]):
    p, ref = e["problem"], e["epilogue"]["ref"]
    epi = ship.resolve_ref(ref) if ref else library.get(e["epilogue"]["id"])
    cfg = space.config_from_dict(e["config"])
    if epi is None or not cfg.epi_wg or (cfg.name, epi.name) in seen:
        continue
    seen.add((cfg.name, epi.name))
    dts, maj = (SHORT[p["in_dtype"]], SHORT[p["out_dtype"]]), (p["a_major"], p["b_major"])
    rows = [compile_variant(cfg, x, *dts, majors=maj, sass=True) for x in (epi, Epilogue())]
    if any("sass" not in r for r in rows):
        print(f"{epi.name} {cfg.name}: no SASS ({rows[0].get('error') or rows[1].get('error')})")
        continue
    g, b = rows[0]["sass"], rows[1]["sass"]
    elems = ewg_unroll(epi) * VEC
    print(f"{p['M']}x{p['N']}x{p['K']} {cfg.name} {epi.name}: {(g['total'] - b['total']) / elems:.1f} SASS / element "
          f"(loop body {g['total'] - b['total']} over {elems} elements), {rows[0]['spill_bytes']} bytes spilled",
          flush=True)
    if args.ops:
        diff = {op: (g.get(op, 0) - b.get(op, 0)) / elems for op in set(g) | set(b) if op != "total"}
        print("   " + ", ".join(f"{op} {v:.2f}" for op, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))
                                if abs(v) >= 0.25))
