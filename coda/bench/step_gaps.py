"""``python -m coda.bench.step_gaps [--model llama-1b] [--stock] [--compile] [--top 15]``: where a training step's GPU
waits for the CPU. The step report's classes sum kernel time; a step's time minus that sum is time the GPU had
nothing to run (fused + compile, llama-1b, H100, fd6ba6c: 134.9 ms a step, 127.8 ms of kernels). One step of a
preset of :mod:`coda.bench.step` under torch.profiler (CPU and CUDA activity, after three warm-up steps); prints
the GPU busy time (union of kernel intervals) against the step's span, the idle gaps grouped by the kernel that
ended them (its launch came late), and the host-device synchronisations (``cudaStreamSynchronize`` and alike,
device-to-host copies) with the innermost torch op that issued each. ``--steady N``: N steps back to back with
only the GPU's activity recorded (the host as fast as unprofiled): the idle a training loop really has."""
from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict

SYNCS = ("Synchronize", "cudaMemcpy", "cudaStreamWaitEvent")


def analyse(trace: dict, top: int = 15, min_gap_us: float = 3.0) -> dict:
    """Gaps and synchronisations of one chrome trace (``prof.export_chrome_trace``); pure (unit-tested)."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kern = sorted((e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    out = {"kernels": len(kern)}
    if not kern:
        return out
    busy, gaps, end = 0.0, defaultdict(lambda: [0, 0.0]), kern[0]["ts"]
    after = defaultdict(lambda: [0, 0.0])  # the same idle time grouped by the kernel that ended before it
    sizes = defaultdict(lambda: [0, 0.0])  # every idle interval (also those under min_gap_us), by its length
    prev = kern[0]["name"]
    for e in kern:
        t0, t1 = e["ts"], e["ts"] + e.get("dur", 0)
        if t0 > end:
            b = next(f"<{u} us" for u in (1, 2, 4, 8, 16, 32, 64, 10 ** 9) if t0 - end < u)
            sizes[b][0] += 1
            sizes[b][1] += t0 - end
        if t0 > end + min_gap_us:
            for table, key in ((gaps, e["name"][:90]), (after, prev[:90])):
                table[key][0] += 1
                table[key][1] += t0 - end
        busy += max(0.0, t1 - max(t0, end))
        if t1 >= end:
            end, prev = t1, e["name"]
    span = end - kern[0]["ts"]

    def rows(table, key):
        return [{key: k, "count": c, "ms": us / 1e3}
                for k, (c, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]]
    out.update(span_ms=span / 1e3, busy_ms=busy / 1e3, idle_ms=(span - busy) / 1e3,
               gaps=rows(gaps, "next_kernel"), gaps_after=rows(after, "previous_kernel"),
               idle_by_length=[{"length": k, "count": c, "ms": us / 1e3} for k, (c, us) in sizes.items()])
    ops = sorted((e for e in evs if e.get("cat") in ("cpu_op", "user_annotation")), key=lambda e: e["ts"])
    syncs = defaultdict(lambda: [0, 0.0])
    for e in evs:
        if e.get("cat") != "cuda_runtime" or not any(s in e["name"] for s in SYNCS):
            continue
        if "cudaMemcpy" in e["name"] and "Async" in e["name"] and e.get("dur", 0) < 20:
            continue  # an asynchronous copy that did not wait
        owner = [o for o in ops if o["ts"] <= e["ts"] <= o["ts"] + o.get("dur", 0)]
        inner = min(owner, key=lambda o: o.get("dur", 0))["name"] if owner else "?"
        s = syncs[(e["name"], inner)]
        s[0] += 1
        s[1] += e.get("dur", 0)
    out["syncs"] = [{"call": c, "op": o, "count": n, "ms": us / 1e3}
                    for (c, o), (n, us) in sorted(syncs.items(), key=lambda kv: -kv[1][1])[:top]]
    return out


def main(argv=None) -> int:
    from .step import shape_parser
    ap = shape_parser()
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--stock", action="store_true", help="the stock model (default: coda.fuse)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--graph", action="store_true", help="the step captured whole in one CUDA graph (the report's "
                    "+graph modes), a replay profiled")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--optimizer", default="adamw-fused", choices=["adamw-fused", "coda-adamw"])
    ap.add_argument("--steady", type=int, default=0, metavar="N",
                    help="N steps back to back, CUDA activity only (no host-side profiling overhead), after two "
                    "unsynchronised steps: the idle of a training loop in steady state, per step")
    ap.add_argument("--trace", default=None, help="also keep the chrome trace here (gzip if it ends in .gz)")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from .step_ops import one_step
    step = one_step(args.model, args.layers, args.batch, args.seq, stock=args.stock, compile=args.compile,
                    optimizer=args.optimizer, graph=args.graph)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if args.steady:  # the host runs ahead as in a training loop; only the GPU's activity is recorded
        step()
        step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steady):
                step()
            torch.cuda.synchronize()
    else:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    res = analyse(trace, args.top)
    if args.trace:
        import gzip
        with (gzip.open if args.trace.endswith(".gz") else open)(args.trace, "wt") as f:
            json.dump(trace, f)
    if args.steady:
        res.update({f"{k}_per_step": res[k] / args.steady for k in ("span_ms", "busy_ms", "idle_ms") if k in res})
    res.update(device=torch.cuda.get_device_name(), mode=("stock" if args.stock else "fused")
               + ("+compile" if args.compile else "") + ("+graph" if args.graph else ""), model=args.model,
               layers=args.layers or "the preset's")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
