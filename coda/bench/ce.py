"""LM head + cross entropy, forward + backward, both modes side by side: ``python -m coda.bench.ce [--H 2048,4096]``.

Per hidden size H (M tokens, V vocabulary, bf16): the median time (``triton.testing.do_bench``) of CODA's fast and
lean modes, the three cuBLAS GEMMs of the same shapes (x W^T, dz W, dz^T x: the floor of any method that forms the
logits once), torch.compile of the stock loss and, when installed, Liger's fused linear cross entropy; each with its
peak memory above inputs and gradients. Also checks loss, dx and dW of each against a float64 reference on a slice.
"""
from __future__ import annotations

import argparse
import gc
import sys

import torch
import torch.nn.functional as F


def _peak_extra(fn, base_bytes: int, x, w) -> float:
    x.grad = w.grad = None  # the previous call's gradients are not part of this one's footprint
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start - base_bytes) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coda.bench.ce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--M", type=int, default=8192)
    ap.add_argument("--V", type=int, default=128256)
    ap.add_argument("--H", default="2048,4096")
    ap.add_argument("--impls", default="fast,lean,cublas,compile,liger")
    args = ap.parse_args(argv)
    from triton.testing import do_bench
    from coda.ops import linear_cross_entropy
    impls = args.impls.split(",")
    M, V = args.M, args.V
    print(f"{torch.cuda.get_device_name()}: M={M}, V={V}, bf16, fwd+bwd; ratio = time / three cuBLAS GEMMs")
    for H in (int(h) for h in args.H.split(",")):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(M, H, device="cuda", generator=g)).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5 * 2).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, V, (M,), device="cuda", generator=g)
        t[::97] = -100
        grads_bytes = x.numel() * 2 + w.numel() * 2

        def step(loss_fn):
            def run():
                x.grad = w.grad = None
                loss_fn().backward()
            return run

        fns = {
            "fast": lambda: linear_cross_entropy(x, w, t, mode="fast", check_targets=False),
            "lean": lambda: linear_cross_entropy(x, w, t, mode="lean", check_targets=False),
            "compile": torch.compile(lambda: F.cross_entropy((x @ w.t()).float(), t, ignore_index=-100)),
        }
        if "liger" in impls:
            try:
                from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as lflce
                fns["liger"] = lambda: lflce(x, w, t, ignore_index=-100)
            except ImportError as e:
                print(f"  liger: not installed ({e})")
        dz = torch.randn(M, V, device="cuda", dtype=torch.bfloat16) if "cublas" in impls else None
        res = {}
        if dz is not None:
            a = lambda: (torch.mm(x, w.t()), torch.mm(dz, w), torch.mm(dz.t(), x))  # noqa: E731
            res["cublas"] = (do_bench(a, warmup=25, rep=200), 0.0)
            del dz
        for k in [i for i in impls if i in fns]:
            fn = step(fns[k])
            fn()
            ms = do_bench(fn, warmup=25, rep=200)
            res[k] = (ms, _peak_extra(fn, grads_bytes, x, w))
            x.grad = w.grad = None
        base = res.get("cublas", (float("nan"),))[0]
        print(f"H={H}: " + "; ".join(f"{k} {ms:.2f} ms ({ms / base:.3f}x), {gb:.2f} GB extra"
                                      for k, (ms, gb) in res.items()), flush=True)
        # accuracy on 512 rows: vs float64, next to torch in bf16 (the 2x rule)
        rows = slice(0, 512)
        xs, ws, ts = x[rows].detach(), w.detach(), t[rows]
        def grads(fn, xx, ww):
            xx, ww = xx.clone().requires_grad_(), ww.clone().requires_grad_()
            fn(xx, ww).backward()
            return xx.grad.double(), ww.grad.double()
        ref = grads(lambda a, b: F.cross_entropy(a @ b.t(), ts, ignore_index=-100), xs.double(), ws.double())
        tor = grads(lambda a, b: F.cross_entropy((a @ b.t()).float(), ts, ignore_index=-100), xs, ws)
        for k in ("fast", "lean"):
            ours = grads(lambda a, b: linear_cross_entropy(a, b, ts, mode=k), xs, ws)
            errs = [((o - r).norm() / r.norm()).item() for o, r in zip(ours, ref)]
            terr = [((o - r).norm() / r.norm()).item() for o, r in zip(tor, ref)]
            print(f"  {k}: rel err dx {errs[0]:.2e} dW {errs[1]:.2e} (torch bf16 {terr[0]:.2e}, {terr[1]:.2e})")
        del x, w
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
