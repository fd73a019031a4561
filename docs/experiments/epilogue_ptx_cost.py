"""CPU: the per-element instruction cost of each shipped H100 entry's epilogue (an energy proxy for the power-bound
GEMM phases; session 40). Each entry's config is compiled for sm_90a with its epilogue and with the identity; the
epilogue's share of the kernel's PTX instructions (fully unrolled over a tile's accumulators, so static counts are
dynamic counts a tile) is divided by the accumulator elements a consumer thread holds: instructions a thread spends
per element, MUFU operations (ex2 / rcp / rsqrt / sqrt / sin / cos / tanh / lg2) and 16-byte-or-smaller global
loads and stores per element. Entries running the epilogue in the epilogue warps (epi_wg) loop instead of unrolling
and are listed without per-element numbers.
Usage: CUTE_DSL_ARCH=sm_90a PYTHONPATH=tests python docs/experiments/epilogue_ptx_cost.py [shipped json]"""
import json
import os
import re
import sys
import tempfile

import cutlass.cute as cute
import cutlass.runtime as crt

from coda.autotune import ship, space
from coda.check import fake_args
from coda.kernels.epilogue import Epilogue
from coda.kernels.gemm_sm90 import GemmSm90
from test_first_use_tuning import _library_epilogues_by_id

MUFU = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ex2|rcp|rsqrt|sqrt|sin|cos|tanh|lg2)\.approx", re.M)
INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?[a-z][a-z0-9_.:]*[\s;]", re.M)
LDG = re.compile(r"^\s*(?:@!?%p\d+\s+)?ld\.global", re.M)
STG = re.compile(r"^\s*(?:@!?%p\d+\s+)?st\.global", re.M)
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def ptx_counts(cfg, epi, in_dt, out_dt, majors):
    with tempfile.TemporaryDirectory() as d:
        (a, b, c), xs = fake_args(epi, in_dt, out_dt, majors)
        if cfg.sched == "dynamic":
            import cutlass
            from cutlass.cute.runtime import make_fake_compact_tensor
            xs.append(make_fake_compact_tensor(cutlass.Int32, (2,), assumed_align=16))
        cute.compile(GemmSm90(cfg, epi), a, b, c, 132, crt.make_fake_stream(), *xs,
                     options=f"--gpu-arch=sm_90a --keep-ptx --dump-dir={d}")
        text = open(next(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx"))).read()
    return len(INSTR.findall(text)), len(MUFU.findall(text)), len(LDG.findall(text)), len(STG.findall(text))


path = sys.argv[1] if len(sys.argv) > 1 else str(ship.SHIPPED_DIR / "h100_sxm.json")
doc = json.loads(open(path).read())
library = _library_epilogues_by_id()
seen = {}
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
    if cfg.epi_wg:
        seen[what] = None
        print(f"| {p['M']}x{p['N']}x{p['K']} | {cfg.name} | {epi.name} | (epilogue warps) | | | |", flush=True)
        continue
    args = (SHORT[p["in_dtype"]], SHORT[p["out_dtype"]], (p["a_major"], p["b_major"]))
    got = ptx_counts(cfg, epi, *args)
    base = ptx_counts(cfg, Epilogue(), *args)
    elems = cfg.tile_m * cfg.tile_n / (128 if cfg.pingpong else 256)
    per = [(g - b_) / elems for g, b_ in zip(got, base)]
    seen[what] = per
    print(f"| {p['M']}x{p['N']}x{p['K']} | {cfg.name} | {epi.name} | {per[0]:.1f} | {per[1]:.2f} | {per[2]:.2f} "
          f"| {per[3]:.2f} |", flush=True)
