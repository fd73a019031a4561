"""``python -m coda.bench.finish [--layers 2]``: the finishing sums of the epilogues' tile partials in a fused
llama-1b step (``kernels.epilogue.finish_reduction``), by shape: how many a step launches and what each costs in
the layout the partials are stored in (per-column: (L, len, tiles), since session 29; per-row: (L, tiles, len))
and with tiles and length swapped. Session 28 saw them as ~65 ``reduce_kernel`` launches of ~12 us a step (see
docs/NOTES.md, session 29, for the layouts' measurements)."""
from __future__ import annotations

import collections
import sys


def record(layers: int):
    """{(shape, op, dim): calls} of one fused step's finish_reduction calls."""
    import importlib
    g = importlib.import_module("coda.gemm")  # the module (coda.gemm is also the function)
    from .step_ops import one_step
    seen = collections.Counter()
    orig = g.finish_reduction

    def spy(p, op, dim):
        seen[(tuple(p.shape), op, dim)] += 1
        return orig(p, op, dim)
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
    print("shape | op | tiles dim | calls | as stored us | the other layout us | max rel diff")
    tot = [0.0, 0.0]
    for (shape, op, dim), n in sorted(seen.items()):
        p = torch.randn(*shape, device="cuda")
        q = p.transpose(1, 2).contiguous()  # the same partials with tiles and length swapped
        ts = [do_bench(lambda: finish_reduction(p.clone() if op == "logsumexp" else p, op, dim), warmup=10, rep=50),
              do_bench(lambda: finish_reduction(q.clone().transpose(1, 2) if op == "logsumexp" else
                                                q.transpose(1, 2), op, dim), warmup=10, rep=50)]
        ref = torch.logsumexp(p.double(), dim) if op == "logsumexp" else p.double().sum(dim) if op == "sum" else \
            p.double().amax(dim)
        err = (finish_reduction(p.clone(), op, dim) - ref).abs().max().item() / ref.abs().max().item()
        for i in range(2):
            tot[i] += n * ts[i] * 1e3
        print(f"{shape} | {op} | {dim} | {n} | {ts[0] * 1e3:.1f} | {ts[1] * 1e3:.1f} | {err:.1e}")
    print(f"per step at {args.layers} layers (us): as stored {tot[0]:.0f}, the other layout {tot[1]:.0f} (the "
          "logsumexp rows include a copy of the partials)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
