"""``python -m coda.bench.finish [--layers 2]``: the finishing sums of the epilogues' tile partials in a fused
llama-1b step (``kernels.epilogue.finish_reduction``: (L, len, tiles) -> (L, len)), by shape: how many a step
launches and what each costs in the partials' layout (tiles innermost, since session 29) and in the one before
((L, tiles, len): torch's strided reduction). Session 28 saw them as ~65 ``reduce_kernel`` launches of ~12 us a
step; session 29 measured 2-4x less per launch with the tiles innermost (docs/NOTES.md)."""
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
    print("shape (L, len, tiles) | op | calls | tiles innermost us | tiles outer (before 5-29) us | max rel diff")
    tot = [0.0, 0.0]
    for (shape, op), n in sorted(seen.items()):
        p = torch.randn(*shape, device="cuda")
        q = p.transpose(1, 2).contiguous()  # the layout of the partials before session 29: (L, tiles, len)
        ts = [do_bench(lambda: finish_reduction(p.clone() if op == "logsumexp" else p, op), warmup=10, rep=50),
              do_bench(lambda: finish_reduction(q.clone().transpose(1, 2) if op == "logsumexp" else
                                                q.transpose(1, 2), op), warmup=10, rep=50)]
        ref = torch.logsumexp(p.double(), 2) if op == "logsumexp" else p.double().sum(2) if op == "sum" else \
            p.double().amax(2)
        err = (finish_reduction(p.clone(), op) - ref).abs().max().item() / ref.abs().max().item()
        for i in range(2):
            tot[i] += n * ts[i] * 1e3
        print(f"{shape} | {op} | {n} | {ts[0] * 1e3:.1f} | {ts[1] * 1e3:.1f} | {err:.1e}")
    print(f"per step at {args.layers} layers (us): tiles innermost {tot[0]:.0f}, tiles outer {tot[1]:.0f} (the "
          "logsumexp rows include a copy of the partials)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
