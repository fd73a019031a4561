"""The command line of the speed-of-light report: ``python -m coda.bench [--ops ...] [--out DIR]`` (see
:mod:`coda.bench`); with ``--model PRESET`` the arguments go to the training-step report (:mod:`coda.bench.step`)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import coda.bench as B
from coda.bench import (DTYPES, IMPLS, REGISTRY, RUN_KEYS, R, Runner, collect_meta, gpu_problem, measure_case,
                        measure_ceilings, parse_shapes, select_specs, unavailable)


def _finish(res: dict) -> int:
    for p in res["written"]:
        print(f"wrote {p}")
    for p, why in res["missing"]:
        print(f"coda.bench: did not write {p}: {why}", file=sys.stderr)
    return 1 if res["missing"] else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m coda.bench", description=B.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="registered ops: " + ", ".join(s.key for s in REGISTRY))
    ap.add_argument("--ops", help="comma-separated ops (e.g. gemm,mlp) or op.mode keys (mlp.fwd); default: all")
    ap.add_argument("--shapes", help="';'-separated shapes: K=V,K=V (e.g. M=4096) or AxBxC for ops sharing one "
                                     "parameter list (e.g. --ops gemm --shapes 8192x8192x8192)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--out", default="bench-results", help="output directory (default: bench-results/)")
    ap.add_argument("--l2-cold", action="store_true", help="rotate inputs over fresh copies (> 2x L2 together)")
    ap.add_argument("--append", action="store_true",
                    help="add to (or replace in) the report.json already in --out, keeping its ceilings: split a "
                         "long benchmark into several runs")
    ap.add_argument("--from", dest="from_", metavar="REPORT_JSON",
                    help="re-render report.md and the PNGs from a saved report.json (no GPU needed)")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    ap.add_argument("--repeats", type=int, default=5, help="do_bench calls per implementation (spread)")
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode (default, max-autotune, ...)")
    ap.add_argument("--model", help="training-step report of a model preset instead (python -m coda.bench --model "
                                    "llama-1b --help: coda.bench.step)")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--model" or a.startswith("--model=") for a in argv):  # the training-step report
        from . import step
        return step.main(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.from_:
        try:
            with open(args.from_) as f:
                report = json.load(f)
        except (OSError, ValueError) as e:
            ap.error(f"--from {args.from_}: {e}")
        if isinstance(report, dict) and "modes" in report and "flops" in report:  # a saved training-step report
            from . import step
            return step.main(["--from", args.from_, "--out", args.out])
        same = os.path.abspath(os.path.join(args.out, "report.json")) == os.path.abspath(args.from_)
        return _finish(R.write_report(report, args.out, write_json=not same))
    try:
        specs = select_specs(args.ops)
        shapes = parse_shapes(args.shapes, specs)
        impls = tuple(x.strip() for x in args.impls.split(",") if x.strip())
        if not impls or set(impls) - set(IMPLS):
            raise ValueError(f"--impls: choose from {','.join(IMPLS)}, got {args.impls!r}")
        if args.repeats < 1:
            raise ValueError("--repeats must be >= 1")
    except ValueError as e:
        ap.error(str(e))
    problem = gpu_problem()
    if problem:
        print(f"coda.bench: cannot measure here: {problem}.\n"
              "The benchmark needs a Hopper (sm_90) GPU. To re-render a saved report without one, run\n"
              f"  python -m coda.bench --from {os.path.join(args.out, 'report.json')} --out {args.out}",
              file=sys.stderr)
        return 2
    if not R.matplotlib_available():
        print("coda.bench: matplotlib is not installed: report.json and report.md will be written, the PNGs not "
              "(pip install 'coda-gemm[bench]')", file=sys.stderr)
    for name in ("recompile_limit", "cache_size_limit"):  # one compile per op, shape and mode
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    run = Runner(device="cuda", dtype=DTYPES[args.dtype], impls=impls, repeats=args.repeats,
                 warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, l2_cold=args.l2_cold, compile_mode=args.compile_mode)
    meta = collect_meta(run, argv)
    print(f"coda.bench on {meta['device']} ({meta['capability']}), {meta['dtype']}, commit {meta['commit']}")
    skipped, cases = [], []
    for s in specs:
        why = unavailable(s)
        if why:
            skipped.append({"op": s.key, "reason": why})
            print(f"  skipped {s.key}: {why}")
        else:
            cases += [(s, shape) for shape in shapes[s.key]]
    report = dict(schema=1, meta=meta, skipped=skipped, ceilings=None, results=[])
    saved = os.path.join(args.out, "report.json")
    if args.append and os.path.exists(saved):
        with open(saved) as f:
            report = json.load(f)
        old = report["meta"]
        if (old.get("device"), old.get("dtype")) != (meta["device"], meta["dtype"]):
            print(f"coda.bench: --append: {saved} was measured on {old.get('device')} in {old.get('dtype')}, this "
                  f"run is {meta['device']} in {meta['dtype']}; use another --out", file=sys.stderr)
            return 2
        old.setdefault("runs", [{k: old.get(k) for k in RUN_KEYS}]).append({k: meta[k] for k in RUN_KEYS})
        measured = {s.key for s, _ in cases}
        report["skipped"] = [x for x in report.get("skipped", []) if x["op"] not in measured
                             and x["op"] not in {y["op"] for y in skipped}] + skipped
        print(f"appending to {saved}; ceilings as measured there ({old.get('date')})")
    else:
        print("ceilings:")
        try:
            report["ceilings"] = measure_ceilings(run)
        except RuntimeError as e:
            print(f"coda.bench: {e}", file=sys.stderr)
            return 1
    g, bw = report["ceilings"]["gemm"], report["ceilings"]["bandwidth"]
    for k, r in g["impls"].items():
        print(R.progress_line(k, r, dict(flops=g["flops"], bytes=1), g["peak_tflops"], bw["gbps"]))
    print(f"    GEMM peak {g['peak_tflops']:.0f} TFLOP/s ({g['peak_source']}), copy bandwidth {bw['gbps']:.0f} GB/s")
    R.save_json(report, args.out)
    for i, (spec, shape) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {spec.key} {R.shape_label(shape)}", flush=True)
        case = measure_case(spec, shape, run)
        for k, r in case["impls"].items():
            print(R.progress_line(k, r, case, g["peak_tflops"], bw["gbps"]), flush=True)
        report["results"] = [c for c in report["results"] if (c["key"], c["shape"]) != (case["key"], case["shape"])]
        report["results"].append(case)
        R.save_json(report, args.out)
    return _finish(R.write_report(report, args.out))


if __name__ == "__main__":
    sys.exit(main())
