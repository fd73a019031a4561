"""CPU: the per-element instruction cost of each shipped H100 entry's epilogue (an energy proxy for the power-bound
GEMM phases; session 40). Each entry's config is compiled for sm_90a with its epilogue and with the identity
(``coda.check.compile_variant``); the epilogue's share of the kernel's PTX instructions (fully unrolled over a
tile's accumulators, so static counts are dynamic counts a tile) is divided by the accumulator elements a consumer
thread holds: instructions a thread spends per element, MUFU operations (ex2 / rcp / rsqrt / sqrt / sin / cos /
tanh / lg2) and global loads and stores per element. Entries running the epilogue in the epilogue warps (epi_wg)
loop instead of unrolling and are listed without per-element numbers.
Usage: CUTE_DSL_ARCH=sm_90a PYTHONPATH=tests python docs/experiments/epilogue_ptx_cost.py [shipped json]"""
import json
import sys

from coda.autotune import ship, space
from coda.check import compile_variant
from coda.kernels.epilogue import Epilogue
from test_first_use_tuning import _library_epilogues_by_id

MUFU = tuple(f"{op}.approx" for op in ("ex2", "rcp", "rsqrt", "sqrt", "sin", "cos", "tanh", "lg2"))
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def counts(cfg, epi, in_dt, out_dt, majors):
    """(instructions, MUFU, ld.global, st.global) of the PTX of ``cfg`` with ``epi``."""
    row = compile_variant(cfg, epi, in_dt, out_dt, majors=majors, count=MUFU + ("ld.global", "st.global"))
    if row.get("ptx_instructions") is None:
        raise RuntimeError(row["error"])
    c = row["count"]
    return row["ptx_instructions"], sum(c[m] for m in MUFU), c["ld.global"], c["st.global"]


path = sys.argv[1] if len(sys.argv) > 1 else str(ship.SHIPPED_DIR / "h100_sxm.json")
doc = json.loads(open(path).read())
library = _library_epilogues_by_id()
seen = set()
print("| entry | config | epilogue | instr / elem | MUFU / elem | ld.global / elem | st.global / elem |")
print("|---|---|---|---|---|---|---|")
for k, e in sorted(doc["entries"].items(), key=lambda kv: kv[1]["name"]):
    p, ref = e["problem"], e["epilogue"]["ref"]
    epi = ship.resolve_ref(ref) if ref else library.get(e["epilogue"]["id"])
    if epi is None or epi.is_identity:
        continue
    cfg = space.config_from_dict(e["config"])
    what = (str(cfg), ship.epilogue_id(epi), p["in_dtype"], p["out_dtype"], p["a_major"], p["b_major"])
    if what in seen:
        continue
    seen.add(what)
    label = f"| {p['M']}x{p['N']}x{p['K']} | {cfg.name} | {epi.name} |"
    if cfg.epi_wg:
        print(f"{label} (epilogue warps) | | | |", flush=True)
        continue
    args = (SHORT[p["in_dtype"]], SHORT[p["out_dtype"]], (p["a_major"], p["b_major"]))
    elems = cfg.tile_m * cfg.tile_n / (128 if cfg.pingpong else 256)
    per = [(g - b) / elems for g, b in zip(counts(cfg, epi, *args), counts(cfg, Epilogue(), *args))]
    print(f"{label} {per[0]:.1f} | {per[1]:.2f} | {per[2]:.2f} | {per[3]:.2f} |", flush=True)
