"""CPU: SASS instructions spent per accumulator element on the epilogue of shipped entries: the kernel's SASS with
the epilogue minus with the identity at the same config (nvdisasm from the nvidia-cuda-nvdisasm wheel on PATH),
with the opcodes that differ most (session 45). Consumer epilogues are unrolled over a tile: the difference is
divided by the elements a consumer thread holds. ``--ewg``: the entries that run in the epilogue warps instead
(coda.optim's dW + update GEMMs and others), whose loop is not unrolled: the difference is one loop body, divided by
the elements a lane handles per pass (ewg_unroll rows x VEC columns) -- a static count, so the cold ragged-edge
paths weigh in. Compare two trees by running it with each on PYTHONPATH first.
Usage: CUTE_DSL_ARCH=sm_90a PYTHONPATH=<tree>:<tree>/tests python docs/experiments/s45_epi_sass.py
       [--ops] [--ewg] [--file h100_sxm.json] [NAME_SUBSTRING ...]"""
import argparse
import json

from coda.autotune import ship, space
from coda.check import compile_variant
from coda.kernels.epilogue import Epilogue
from coda.kernels.epilogue_wg import VEC, ewg_unroll
from test_first_use_tuning import _library_epilogues_by_id

SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
ap = argparse.ArgumentParser()
ap.add_argument("names", nargs="*", help="epilogue name substrings (default: every entry)")
ap.add_argument("--file", default="h100_sxm.json")
ap.add_argument("--ewg", action="store_true", help="the epilogue-warp entries instead of the consumer ones")
ap.add_argument("--ops", action="store_true", help="print the opcode differences too")
args = ap.parse_args()
doc = json.loads(open(ship.SHIPPED_DIR / args.file).read())
library = _library_epilogues_by_id()
seen = set()
for k, e in sorted(doc["entries"].items(), key=lambda kv: kv[1]["name"]):
    p, ref = e["problem"], e["epilogue"]["ref"]
    epi = ship.resolve_ref(ref) if ref else library.get(e["epilogue"]["id"])
    if epi is None or (args.names and not any(n in epi.name for n in args.names)):
        continue
    cfg = space.config_from_dict(e["config"])
    if cfg.epi_wg != args.ewg or (cfg.name, epi.name) in seen:
        continue
    seen.add((cfg.name, epi.name))
    dts, maj = (SHORT[p["in_dtype"]], SHORT[p["out_dtype"]]), (p["a_major"], p["b_major"])
    elems = ewg_unroll(epi) * VEC if cfg.epi_wg else cfg.tile_m * cfg.tile_n / (128 if cfg.pingpong else 256)
    rows = [compile_variant(cfg, x, *dts, majors=maj, sass=True) for x in (epi, Epilogue())]
    if any("sass" not in r for r in rows):
        print(f"{epi.name} {cfg.name}: no SASS ({rows[0].get('error') or rows[1].get('error')})")
        continue
    g, b = rows[0]["sass"], rows[1]["sass"]
    print(f"{p['M']}x{p['N']}x{p['K']} {cfg.name} {epi.name}: {(g['total'] - b['total']) / elems:.1f} SASS / element, "
          f"{rows[0]['registers']} registers, {rows[0]['spill_bytes']} bytes spilled", flush=True)
    if args.ops:
        diff = {op: (g.get(op, 0) - b.get(op, 0)) / elems for op in set(g) | set(b) if op != "total"}
        print("   " + ", ".join(f"{op} {v:.2f}" for op, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))
                                if abs(v) >= 0.1))
