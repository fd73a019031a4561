"""Hardware counters of CODA's GEMM next to cuBLAS's, from Nsight Compute: where a wall-clock ratio comes from.

``python -m coda.bench.ncu [--shapes MxNxK,...] [--epilogues scale_bias,ce_forward,...] [--config K=V,...] [--md FILE]``

Wall-clock ratios on an H100 move by several percent from run to run (clock and power state); counters do not.
For each shape this runs cuBLAS (``torch.mm``), CODA's plain GEMM and the named fused epilogues once each, inside
NVTX ranges, under ``ncu --clock-control none`` (the GPU's clocks are left alone), and tabulates per kernel:

- SM cycles (``sm__cycles_elapsed.max``): the work in clock cycles, whatever the clock was;
- the clock it ran at (cycles / duration) and the duration;
- tensor-pipe utilisation (``sm__pipe_tensor_cycles_active``), of elapsed and of active SM cycles: a GEMM at the
  hardware limit is at ~95-96 %; the gap between the two is SM idle time (tail wave, launch);
- DRAM bytes read and the L2 hit rate: the memory traffic the tile order causes (it drives power, hence clocks).

The process re-launches itself under ``ncu`` (``--child`` is that inner run); ``ncu`` must be on PATH.
Heuristic configs (``CODA_AUTOTUNE=0``), bf16; each ``--config`` adds the plain GEMM with those fields changed from
the large-problem heuristic default (128x256 cooperative, cluster 2x1, ``sched="dynamic"``), e.g. ``--config
sched=static`` or ``--config cluster_m=1``, labelled by them.
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile

SHAPES = [(8192, 8192, 8192), (8192, 4096, 4096), (8192, 28672, 4096), (8192, 4096, 14336), (8192, 128256, 4096)]
RANGE = "coda_ncu"
METRICS = {"cycles": "sm__cycles_elapsed.max", "ms": "gpu__time_duration.sum",
           "tensor_elapsed": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
           "tensor_active": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
           "dram": "dram__bytes_read.sum", "l2_hit": "lts__t_sector_hit_rate.pct"}
# the GEMM kernels themselves (cuBLAS's names, CODA's GemmSm90), not the small torch kernels around them
KERNELS = "regex:GemmSm90|gemm|nvjet|xmma"
_UNIT = {"ms": {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "nsecond": 1e-6, "s": 1e3},
         "dram": {"byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0, "Tbyte": 1e3}}


def _label_of(cell: str) -> str:
    """The innermost NVTX range of a kernel row (``"<default domain>:NAME:none:..."`` entries, outermost first)."""
    names = re.findall(r"<default domain>:([^:\"]+):", cell)
    return names[-1] if names else ""


def parse_raw_csv(text: str) -> list[dict]:
    """Rows of ``ncu --page raw --csv`` -> [{label, kernel, cycles, ms, clock_ghz, tensor_*, dram (GB), l2_hit}]."""
    rows = list(csv.reader(text.splitlines()))
    if len(rows) < 3:
        return []
    head, units = rows[0], rows[1]
    nvtx = next((c for c in head if c.startswith("thread Domain:Push/Pop_Range")), None)
    out = []
    for r in rows[2:]:
        d, u = dict(zip(head, r)), dict(zip(head, units))
        name = d.get("Kernel Name", "")
        row = {"label": _label_of(d.get(nvtx, "")) if nvtx else "",
               "kernel": "GemmSm90" if "GemmSm90" in name else name}
        for key, metric in METRICS.items():
            if metric not in d or d[metric] in ("", "n/a"):
                row[key] = None
                continue
            v = float(d[metric].replace(",", ""))
            row[key] = v * _UNIT[key][u[metric]] if key in _UNIT else v
        row["clock_ghz"] = (row["cycles"] / (row["ms"] * 1e6)) if row["cycles"] and row["ms"] else None
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    """Markdown: one line per kernel, grouped by shape, cycles as a ratio to the shape's cuBLAS kernel."""
    lines = ["| shape | impl | kernel | ms | clock GHz | Mcycles | / cuBLAS cycles | tensor % elapsed | "
             "tensor % active | DRAM read GB | L2 hit % |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        impl, _, shape = r["label"].partition("@")
        if impl == "cublas" and shape not in base:
            base[shape] = r["cycles"]
    f = lambda v, p: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in rows:
        impl, _, shape = r["label"].partition("@")
        ratio = r["cycles"] / base[shape] if base.get(shape) and r["cycles"] else None
        lines.append(f"| {shape} | {impl} | {r['kernel'][:28]} | {f(r['ms'], 3)} | {f(r['clock_ghz'], 3)} | "
                     f"{f(r['cycles'] and r['cycles'] / 1e6, 3)} | {f(ratio, 3)} | {f(r['tensor_elapsed'], 1)} | "
                     f"{f(r['tensor_active'], 1)} | {f(r['dram'], 2)} | {f(r['l2_hit'], 1)} |")
    return "\n".join(lines)


def parse_config(text: str):
    """``"cluster_m=1,sched=dynamic"`` -> (label, GemmConfig of the heuristic default with those fields); ValueError
    naming the field or value that is not one."""
    import dataclasses

    from coda.config import GemmConfig, default_config
    fields = {f.name: f for f in dataclasses.fields(GemmConfig)}
    kw = {}
    for item in text.split(","):
        key, sep, val = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"{item!r} is not FIELD=VALUE with a GemmConfig field ({', '.join(fields)})")
        if val in ("True", "False"):
            kw[key] = val == "True"
        elif val == "None":
            kw[key] = None
        else:
            try:
                kw[key] = int(val)
            except ValueError:
                kw[key] = val
    cfg = dataclasses.replace(default_config(8192, 8192, 8192), **kw)
    problems = cfg.problems()
    if problems:
        raise ValueError("; ".join(problems))
    return "coda[" + text + "]", cfg


def _child(shapes, epilogues, configs=()):
    """The run ncu profiles: every implementation once per shape, each in its own NVTX range."""
    import torch

    import coda
    from coda.bench.epilogue import EPILOGUES, operands
    from coda.epilogues.cross_entropy import ce_forward
    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        fns = {"cublas": lambda: torch.mm(a, b.t(), out=out), "coda": lambda: coda.gemm(a, b, out=out)}
        for label, cfg in map(parse_config, configs):
            fns[label] = lambda cfg=cfg: coda.gemm(a, b, out=out, config=cfg)
        for name in epilogues:
            if name == "ce_forward":  # logits never stored: per-row reductions only
                t = torch.randint(0, N, (M,), device="cuda").float()
                fns[name] = lambda t=t: coda.gemm(a, b, epilogue=ce_forward, t=t)
            else:
                ops = operands(name, M, N)
                fns[name] = lambda epi=EPILOGUES[name], ops=ops: coda.gemm(a, b, epilogue=epi, **ops)
        for f in fns.values():  # compile and warm up outside the profiled ranges
            f(), f()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(RANGE)
        for name, f in fns.items():
            torch.cuda.nvtx.range_push(f"{name}@{M}x{N}x{K}")
            f()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_pop()
        del a, b, out, fns


def run(shapes, epilogues, ncu: str = "ncu", configs=()) -> list[dict]:
    """Profile the child run under ncu; returns the parsed rows."""
    args = ["--shapes", ",".join("x".join(map(str, s)) for s in shapes)]
    if epilogues:
        args += ["--epilogues", ",".join(epilogues)]
    for c in configs:
        args += ["--config", c]
    env = dict(os.environ, CODA_AUTOTUNE="0")
    with tempfile.TemporaryDirectory() as d:
        rep = os.path.join(d, "report")
        subprocess.run([ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", f"{RANGE}/",
                        "--kernel-name", KERNELS, "--metrics", ",".join(METRICS.values()), "-o", rep,
                        sys.executable, "-m", "coda.bench.ncu", "--child", *args], check=True, env=env)
        raw = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--page", "raw", "--csv"], check=True,
                             capture_output=True, text=True).stdout
    return parse_raw_csv(raw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=None, help="MxNxK,MxNxK,... (default: the issue-2 GEMM shapes)")
    ap.add_argument("--epilogues", default="", help="fused epilogues to profile beside the plain GEMM: "
                    "scale_bias, sumsq, bias_gelu, residual, swiglu, ce_forward")
    ap.add_argument("--config", action="append", default=[], help="also the plain GEMM with these GemmConfig "
                    "fields changed, e.g. cluster_m=1,sched=dynamic (repeatable)")
    ap.add_argument("--md", default=None, help="also write the markdown table to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        shapes = SHAPES if not a.shapes else [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
        if any(len(s) != 3 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        ap.error(f"--shapes: expected MxNxK,... with positive integers, got {a.shapes!r}")
    from coda.bench.epilogue import EPILOGUES
    epilogues = [e for e in a.epilogues.split(",") if e]
    unknown = sorted(set(epilogues) - set(EPILOGUES) - {"ce_forward"})
    if unknown:
        ap.error(f"--epilogues: unknown {unknown}; known: {sorted(EPILOGUES) + ['ce_forward']}")
    for c in a.config:
        try:
            parse_config(c)
        except ValueError as e:
            ap.error(f"--config {c!r}: {e}")
    if a.child:
        _child(shapes, epilogues, a.config)
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("coda.bench.ncu: Nsight Compute (ncu) is not on PATH", file=sys.stderr)
        return 2
    from coda._device import hopper_available
    if not hopper_available():
        print("coda.bench.ncu: needs a Hopper (sm_90) GPU", file=sys.stderr)
        return 2
    md = table(run(shapes, epilogues, ncu, a.config))
    print(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
