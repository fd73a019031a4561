"""``python -m coda.bench.finish [--layers 2]``: the finishing sums of the epilogues' tile partials in a fused
llama-1b step (``kernels.epilogue.finish_reduction``: (L, tiles, len) -> (L, len)), by shape: how many a step
launches and what each costs with torch's reduction against alternatives, all exact in fp32 up to summation order.
Session 28 saw them as ~65 ``reduce_kernel`` launches of ~12 us a step (docs/NOTES.md)."""
from __future__ import annotations

import collections
import sys


def record(layers: int):
    """{(shape, op): calls} of one fused step's finish_reduction calls."""
    import importlib
    g = importlib.import_module("coda.gemm")  # the module (coda.gemm is also the function)
    from .step_ops import one_step
    seen = collections.Counter()
    orig = g.finish_reduction

    def spy(p, op):
        seen[(tuple(p.shape), op)] += 1
        return orig(p, op)
    step = one_step("llama-1b", layers, 2, 4096, optimizer="coda-adamw")
    step()
    g.finish_reduction = spy
    try:
        step()
    finally:
        g.finish_reduction = orig
    return seen


def main(argv=None) -> int:
    import argparse
    import torch
    from triton.testing import do_bench

    from coda.kernels.epilogue import finish_reduction
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    seen = record(args.layers)
    print(f"{torch.cuda.get_device_name()}: finish_reduction calls of one fused llama-1b step, {args.layers} layers")
    print("shape (L, tiles, len) | op | calls | torch sum us | library us | two-stage us | max rel diff")
    tot = [0.0, 0.0, 0.0]
    for (shape, op), n in sorted(seen.items()):
        p = torch.randn(*shape, device="cuda")
        if op == "sum":
            fns = [lambda: p.sum(dim=1), lambda: finish_reduction(p, "sum")]  # library: SGEMV for >= 16 tiles
            k = next((k for k in (16, 8, 4) if shape[1] % k == 0 and shape[1] > k), None)
            fns.append((lambda: p.view(shape[0], shape[1] // k, k, shape[2]).sum(2).sum(1)) if k else fns[0])
            ref = p.double().sum(dim=1)
        else:  # max / logsumexp: the library's finishing alone (a logsumexp consumes its partials: on a copy)
            fns = [lambda: finish_reduction(p.clone(), op)] * 3
            ref = p.double().logsumexp(dim=1) if op == "logsumexp" else p.double().amax(dim=1)
        us = {}  # each distinct function timed once
        for f in fns:
            if f not in us:
                us[f] = do_bench(f, warmup=10, rep=50) * 1e3
        ts = [us[f] for f in fns]
        err = max(((f() - ref).abs().max() / ref.abs().max()).item() for f in fns)
        for i in range(3):
            tot[i] += n * ts[i]
        print(f"{shape} | {op} | {n} | {ts[0]:.1f} | {ts[1]:.1f} | {ts[2]:.1f} | {err:.1e}")
    print(f"per step at {args.layers} layers (us): torch sum {tot[0]:.0f}, library {tot[1]:.0f}, two-stage {tot[2]:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
