"""``python -m coda.bench.ncu_source PROBLEM [--config FIELDS] [--top N]``: where one kernel's warps stall, by SASS
instruction (Nsight Compute's source page: warp-stall samples per instruction), for a problem of
``coda.bench.epi_wg`` under one config (default: the epilogue warps, 128 x 256, cluster 2 x 1).

Prints the N instructions with the most stall samples, each with its share of all samples and its top stall
reasons, then the samples summed per reason. The process re-launches itself under ``ncu`` (``--child``); ``ncu``
must be on PATH. Used for issue 29 (why the epilogue warps of the fused da take longer than a mainloop).
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile


def _config(fields: str):
    from coda.config import GemmConfig
    kw = {}
    for f in filter(None, fields.split(",")):
        k, v = f.split("=")
        kw[k] = v if k in ("raster", "sched") else (v == "1" if k in ("epi_wg", "pingpong") else int(v))
    return GemmConfig(**{"epi_wg": True, **kw})


def child(problem: str, fields: str) -> None:
    import torch

    import coda
    from coda.bench.epi_wg import problems
    make, epi = problems()[problem]
    a, b, ops, _ = make()
    ops = {k: v for k, v in ops.items() if k in {o.name for o in epi.operands}}
    kw = {"out": ops["p"]} if "p" in ops else {}
    cfg = _config(fields)
    for _ in range(3):  # compile, warm up; the profiled launch is the last one
        coda.gemm(a, b, epilogue=epi, config=cfg, **kw, **ops)
    torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coda.bench.ncu_source", description=__doc__.split("\n\n")[0])
    ap.add_argument("problem")
    ap.add_argument("--config", default="", help="GemmConfig fields over epi_wg=1, e.g. 'tile_n=128,cluster_m=1'")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.problem, args.config)
        return 0
    if shutil.which("ncu") is None:
        print("ncu not on PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        rep = os.path.join(d, "prof")
        subprocess.run(["ncu", "--section", "SourceCounters", "--section", "WarpStateStats", "-k", "regex:GemmSm90",
                        "--launch-skip", "2", "--launch-count", "1", "-f", "-o", rep, sys.executable, "-m",
                        "coda.bench.ncu_source", args.problem, "--config", args.config, "--child"], check=True,
                       stdout=subprocess.DEVNULL)
        out = subprocess.run(["ncu", "-i", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                             check=True, capture_output=True, text=True).stdout
    if os.environ.get("NCU_SOURCE_CSV"):  # keep the raw page
        open(os.environ["NCU_SOURCE_CSV"], "w").write(out)
    print(f"{args.problem} [{_config(args.config).name}]")
    print("\n".join(summarize(out, args.top)))
    return 0


def summarize(out: str, top: int = 25) -> list:
    """Lines of the report from ncu's source page CSV (``--page source --csv --print-source sass``): the ``top``
    instructions by warp-stall samples (share, executions, SASS, top two reasons), then the share per reason."""
    text = out[out.index('"Address"'):]  # (past the "Kernel Name" line)
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        return ["no source rows"]
    samp = next(k for k in rows[0] if k and k.startswith("Warp Stall Sampling (All"))
    reasons = [k for k in rows[0] if k and k.startswith("stall_") and "Not Issued" not in k]

    def num(x):
        try:
            return float(str(x).replace(",", ""))
        except ValueError:
            return 0.0
    total = sum(num(r[samp]) for r in rows) or 1.0
    lines = [f"{int(total)} stall samples over {len(rows)} instructions"]
    for r in sorted(rows, key=lambda r: -num(r[samp]))[:top]:
        best = sorted(((num(r[k]), k) for k in reasons), reverse=True)[:2]
        why = ", ".join(f"{k[6:]} {v / max(num(r[samp]), 1):.0%}" for v, k in best if v)
        lines.append(f"{num(r[samp]) / total:6.1%} {num(r.get('Instructions Executed', 0)):10.0f}  "
                     f"{r.get('Source', '').strip()[:60]:60s}  {why}")
    sums = sorted(((sum(num(r[k]) for r in rows), k) for k in reasons), reverse=True)[:10]
    lines.append("per reason: " + ", ".join(f"{k[6:]} {v / total:.1%}" for v, k in sums if v))
    return lines

if __name__ == "__main__":
    sys.exit(main())
