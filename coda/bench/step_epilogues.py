"""``python -m coda.bench.step_epilogues [--model llama-1b] [--batch 2] [--seq 4096]``: where a fused step's GEMM
time goes. Records every problem one fused training step hands to ``coda.gemm`` (``coda.autotune.model.Recorder``:
shape, layouts, epilogue, operands, number of calls), then times each on random inputs of the recorded shapes and
strides (do_bench medians, same process, interleaved): the fused call, our plain GEMM of the same shape and layouts,
and cuBLAS (``torch.matmul``); a K = 0 pass (an epilogue over a zero accumulator: norm backwards, RoPE
un-rotation) has no GEMM to compare with and is reported with its bytes moved. Prints one row per problem, times
per step (x calls) and the totals: what the epilogues add over our plain GEMMs and over cuBLAS.
``--only A,B`` keeps the problems whose label contains A or B; ``--configs "F=V,F=V;F=V"`` (``;`` between configs,
fields as in ``coda.bench.ncu``) also times each kept problem's fused call under those configs (K = 0 passes run
one all-zero k-tile: ``stages`` as the heuristic sets it); ``--l2-prefetch 8,16`` also times each problem with
TileMN operands and a mainloop under the config it was served with ``l2_prefetch`` set (issue 29), paired.
The configs are those ``coda.gemm`` serves in this environment: leave ``CODA_AUTOTUNE`` unset to time what the step
runs (stored, then shipped configs); ``CODA_AUTOTUNE=0`` times the heuristic's (the "source" column says which).
"""
from __future__ import annotations

import sys


def _bytes(t) -> int:
    return t.numel() * t.element_size() if hasattr(t, "numel") else 0


def prefetch_configs(rec, values) -> list:
    """[(label, config)]: ``rec``'s served config with ``l2_prefetch`` = each of ``values``, where it applies (TileMN
    operands, K > 0)."""
    import dataclasses

    from coda.kernels.operand_kinds import TILE
    if rec.prob.zero_k or not any(o.spec is TILE for o in rec.epi.operands):
        return []
    return [(f"pf{v}", dataclasses.replace(rec.config, l2_prefetch=v)) for v in values]


def time_problem(rec, bench, configs=()) -> dict:
    """{fused, plain, cublas (ms; None where not applicable), moved (bytes of a K = 0 pass), configs ({label: ms
    of the fused call under that config; stages 2 for a K = 0 pass, as the heuristic has it})} of one problem, all
    on one set of inputs."""
    import dataclasses

    import torch

    import coda
    from coda.autotune.model import inputs_for
    a, b, ops = inputs_for(rec)
    p = rec.prob

    def fused(cfg=None):
        return coda.gemm(a, b, epilogue=rec.epi, out_dtype=p.out_dtype, config=cfg, **ops)

    res = fused()
    row = dict(fused=bench(fused), plain=None, cublas=None, moved=0, configs={})
    for label, cfg in configs:
        cfg = dataclasses.replace(cfg, stages=2) if p.zero_k else cfg
        row["configs"][label] = bench(lambda: fused(cfg))
    if p.zero_k:
        outs = res.values() if isinstance(res, dict) else [res]
        row["moved"] = sum(_bytes(t) for t in ops.values()) + sum(_bytes(t) for t in outs)
    else:
        plain = lambda: coda.gemm(a, b, out_dtype=p.out_dtype)  # noqa: E731
        cub = lambda: torch.matmul(a, b.transpose(-1, -2))  # noqa: E731
        plain(), cub()
        row["plain"], row["cublas"] = bench(plain), bench(cub)
    del a, b, ops, res
    return row


def main(argv=None) -> int:
    from .step import shape_parser
    ap = shape_parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="do_bench runs per timing (median)")
    ap.add_argument("--only", default=None,
                    help="keep the problems whose label contains one of these (comma separated)")
    ap.add_argument("--configs", default=None, help="configs to time the fused call under, ';' between them")
    ap.add_argument("--l2-prefetch", default=None,
                    help="l2_prefetch values (comma separated) to time each problem's own config with")
    args = ap.parse_args(argv)
    pf = [int(v) for v in args.l2_prefetch.split(",")] if args.l2_prefetch else []
    import torch
    from coda.autotune.model import record_model_step

    from .gemm import median_of_runs

    def bench(fn):
        return median_of_runs(fn, args.reps, rep_ms=40)

    problems = [p for p in record_model_step(args.model, args.batch, args.seq)
                if args.only is None or any(o in p.label for o in args.only.split(","))]
    from .ncu import parse_config
    configs = [parse_config(c) for c in args.configs.split(";")] if args.configs else []
    print(f"{torch.cuda.get_device_name()}  {args.model} batch {args.batch} x {args.seq}: {len(problems)} problems")
    print(f"{'problem':58s} {'calls':>5s} {'fused':>8s} {'plain':>8s} {'cuBLAS':>8s} {'f/p':>6s} {'f/cb':>6s} "
          f"{'+ms/step':>8s}  source")
    tot = dict(fused=0.0, plain=0.0, cublas=0.0, passes=0.0, moved=0)
    for rec in problems:
        try:
            r = time_problem(rec, bench, configs + prefetch_configs(rec, pf))
            for label, ms in r["configs"].items():
                print(f"  {rec.label[:40]:40s} {label:46s} {ms:8.3f} ms ({ms / r['fused']:.3f}x fused)", flush=True)
        except Exception as e:  # one problem failing must not lose the others
            print(f"{rec.label[:58]:58s} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        n = rec.calls
        if r["plain"] is None:
            tot["passes"] += r["fused"] * n
            tot["moved"] += r["moved"] * n
            gbs = r["moved"] / r["fused"] / 1e6
            print(f"{rec.label[:58]:58s} {n:5d} {r['fused']:8.3f} {'K=0':>8s} {'':8s} {gbs:6.0f} {'GB/s':>6s} "
                  f"{r['fused'] * n:8.3f}  {rec.source}")
        else:
            for k in ("fused", "plain", "cublas"):
                tot[k] += r[k] * n
            print(f"{rec.label[:58]:58s} {n:5d} {r['fused']:8.3f} {r['plain']:8.3f} {r['cublas']:8.3f} "
                  f"{r['fused'] / r['plain']:6.3f} {r['fused'] / r['cublas']:6.3f} "
                  f"{(r['fused'] - r['cublas']) * n:8.3f}  {rec.source}", flush=True)
    print(f"per step: fused GEMMs {tot['fused']:.2f} ms, the same as plain GEMMs {tot['plain']:.2f} (ours) / "
          f"{tot['cublas']:.2f} (cuBLAS): epilogues add {tot['fused'] - tot['plain']:.2f} / "
          f"{tot['fused'] - tot['cublas']:.2f} ms; K = 0 passes {tot['passes']:.2f} ms "
          f"({tot['moved'] / max(tot['passes'], 1e-9) / 1e6:.0f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
