"""``python -m coda.bench.epi_wg [--only NAME,...]``: the epilogue warps (``GemmConfig(epi_wg=True)``) against the
shared epilogue and cuBLAS on the llama-1b step's heavy epilogues, on one GPU (issue 29).

Per problem: cuBLAS's plain GEMM of the shape (``torch.mm``: the floor), CODA's fused call under its default config
(stored / shipped / heuristic) and under epi_wg variants (128 x 256 and 128 x 128, cluster 1x1 and 2x1), each
checked against the default's results (relative error; the epilogue warps see the accumulator rounded to bf16).
Medians of ``triton.testing.do_bench`` (L2 flushed), ms, and the ratio to cuBLAS.

Problems (llama-1b, T = 8192 tokens): ``fused_da`` (the SwiGLU backward in da = dy W_down: 8192 x 8192 x 2048, a 1 -> 2
epilogue with d_r's row partials), ``swiglu_fwd`` (norm row scale + SwiGLU + the pre-activation stores: 8192 x 16384
x 2048, pairs), ``radial`` (the MLP's dX with the norm's radial term and the residual: 8192 x 2048 x 16384),
``adamw`` (gate/up dW with the AdamW update in place: 16384 x 2048 x 8192 on transposed views).
"""
from __future__ import annotations

import argparse
import sys


def problems():
    """{name: (make, epilogue): make() -> (a, b, operands, cuBLAS lambda)}."""
    import torch

    from coda.autodiff import with_preact
    from coda.epilogues.adamw import HYPER, adamw
    from coda.epilogues.cross_entropy import ce_forward_logits
    from coda.ops.mlp import dacc_on_da, rms_radial_residual, rms_swiglu
    bf = dict(device="cuda", dtype=torch.bfloat16)
    T, H, I = 8192, 2048, 8192

    def fused_da():
        dy, wd = torch.randn(T, H, **bf), torch.randn(H, I, **bf)
        ops = dict(r=torch.rand(T, device="cuda") + 0.5, _preact_even=torch.randn(T, I, **bf),
                   _preact_odd=torch.randn(T, I, **bf))
        return dy, wd.t(), ops, lambda: torch.mm(dy, wd)

    def swiglu_fwd():
        x, w = torch.randn(T, H, **bf), torch.randn(2 * I, H, **bf)
        return x, w, dict(r=torch.rand(T, device="cuda") + 0.5), lambda: torch.mm(x, w.t())

    def radial():
        dacc, w = torch.randn(T, 2 * I, **bf), torch.randn(2 * I, H, **bf)
        ops = dict(gamma=torch.rand(H, device="cuda") + 0.5, r=torch.rand(T, device="cuda") + 0.5,
                   dr=torch.randn(T, device="cuda"), inv_h=1.0 / H, h=torch.randn(T, H, **bf),
                   dres=torch.randn(T, H, **bf))
        return dacc, w.t(), ops, lambda: torch.mm(dacc, w)

    def logits():  # the fast cross entropy's logits GEMM, one chunk of all tokens (its path under coda.optim)
        x, w = torch.randn(T, H, **bf), torch.randn(128256, H, **bf)
        return x, w, {}, lambda: torch.mm(x, w.t())

    def adamw_dw(rows=2 * I, cols=H):
        dacc, x = torch.randn(T, rows, **bf), torch.randn(T, cols, **bf)
        h = torch.tensor([0.9, 0.1, 0.95, 0.05, 1.2, 1e-8, 1e-4, 1.0], device="cuda").unsqueeze(1).repeat(1, 4)
        p = torch.randn(rows, cols, **bf)
        ops = dict(p=p, m=torch.zeros_like(p), v=torch.zeros_like(p), **{n: h[i, :1] for i, n in enumerate(HYPER)})
        return dacc.t(), x.t(), ops, lambda: torch.mm(dacc.t(), x)

    from coda.dsl import ACC, ODD_OUT, DslEpilogue, operand_symbol
    da = dacc_on_da((("out",), ("r",), False))
    # diagnostics of the fused da's cost in the epilogue warps: its math without d_r's row partials, and the same
    # traffic (two TileMN reads, a 1 -> 2 output) with one multiply per value
    da_nored = DslEpilogue("da_nored", da.operands, da.exprs, {}, expand=True)
    g, u = (operand_symbol(k) for k in ("_preact_even", "_preact_odd"))
    da_simple = DslEpilogue("da_simple", da.operands, {"out": ACC * g, ODD_OUT: ACC * u}, {}, expand=True)
    from coda.kernels.epilogue import IDENTITY
    # the fused da's shape with parts of its traffic: the plain GEMM, a 1 -> 2 output of acc alone, the two TileMN
    # reads alone (into a row sum)
    dup = DslEpilogue("da_stores", (), {"out": ACC, ODD_OUT: 2 * ACC}, {}, expand=True)
    loads = DslEpilogue("da_loads", da.operands, {}, {"s": ("n", "sum", ACC * g + u)})
    return {"fused_da": (fused_da, da), "da_nored": (fused_da, da_nored), "da_simple": (fused_da, da_simple),
            "da_plain": (fused_da, IDENTITY), "da_stores": (fused_da, dup), "da_loads": (fused_da, loads),
            "swiglu_fwd": (swiglu_fwd, with_preact(rms_swiglu)), "radial": (radial, rms_radial_residual),
            "logits": (logits, ce_forward_logits(torch.bfloat16)), "adamw": (adamw_dw, adamw),
            "adamw_wide": (lambda: adamw_dw(H, I), adamw),
            "adamw_plain": (adamw_dw, IDENTITY)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coda.bench.epi_wg", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated problem names (default: the step's four; also "
                    "adamw_wide (the down projection's update), adamw_plain (adamw's dW GEMM without the update), "
                    "logits (the fast cross entropy's logits GEMM, 8192 x 128256 x 2048), da_nored, da_simple, "
                    "da_plain, da_stores, da_loads: the fused da without its row partials / with trivial math / the "
                    "plain GEMM / its stores alone / its loads alone)")
    ap.add_argument("--no-ewg", action="store_true", help="only --variants (not the four epilogue-warp configs)")
    ap.add_argument("--variants", default="", help="more epi_wg configs: ';'-separated GemmConfig fields, e.g. "
                    "'raster=n;cluster_m=1,swizzle=1'")
    args = ap.parse_args(argv)
    import torch
    from triton.testing import do_bench

    import coda
    from coda.config import GemmConfig

    variants = {} if args.no_ewg else {f"ewg {tn} c{cm}": GemmConfig(tile_n=tn, cluster_m=cm, epi_wg=True)
                                      for tn in (256, 128) for cm in (1, 2)}
    for spec in filter(None, args.variants.split(";")):  # e.g. "raster=n,swizzle=1"
        kw = {k: (v if k in ("raster", "sched") else bool(int(v)) if k in ("epi_wg", "pingpong") else int(v))
              for k, v in (f.split("=") for f in spec.split(","))}  # (epi_wg=0: the consumer warps' epilogue)
        variants[f"{'ewg ' if kw.get('epi_wg', True) else ''}{spec}"] = GemmConfig(**{"epi_wg": True, **kw})
    only = set(filter(None, args.only.split(","))) or {"fused_da", "swiglu_fwd", "radial", "adamw"}
    print(f"{torch.cuda.get_device_name()}: ms (median), / cuBLAS plain GEMM; err vs the default config")
    for name, (make, epi) in problems().items():
        if name not in only:
            continue
        a, b, ops, cublas = make()
        ops = {k: v for k, v in ops.items() if k in {o.name for o in epi.operands}}  # (the diagnostics use fewer)
        t_cublas = do_bench(cublas, warmup=25, rep=100)
        inplace = {k: v.clone() for k, v in ops.items() if k in getattr(epi, "inplace", ()) or k == "p"}

        def call(cfg=None, restore=False):
            if restore:  # an in-place update compared from the same state (timed runs just keep updating)
                for k, v in inplace.items():
                    ops[k].copy_(v)
            kw = {"out": ops["p"]} if "p" in inplace else {}
            return coda.gemm(a, b, epilogue=epi, config=cfg, **kw, **ops)

        def flat(r):
            return {k: v.float().clone() for k, v in (r.items() if isinstance(r, dict) else {"out": r}.items())}

        ref = flat(call(restore=True))
        row = [f"cuBLAS {t_cublas:.3f}", f"default {do_bench(call, warmup=25, rep=100):.3f}"]
        for label, cfg in variants.items():
            try:
                got = flat(call(cfg, restore=True))
                err = max(((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item() for k in ref)
                t = do_bench(lambda: call(cfg), warmup=25, rep=100)
                row.append(f"{label} {t:.3f} ({t / t_cublas:.3f}x, err {err:.1e})")
            except Exception as e:  # noqa: BLE001 (a variant the kernel refuses)
                row.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
        print(f"{name}: " + "; ".join(row), flush=True)
        del a, b, ops
    return 0


if __name__ == "__main__":
    sys.exit(main())
