"""``python -m coda.bench.optim [--model llama-1b] [--configs CFG ...] [--pass-configs CFG ...]``: the optimizer in the
backward (``coda.optim``, ``epilogues/adamw.py``) against what it replaces, per weight of one decoder layer and the LM
head, on one GPU.

For each weight W (N x K) with T tokens: cuBLAS's dW = dy^T x, CODA's plain dW GEMM (on the transposed views the ops
use), torch's fused AdamW step of W alone (``torch._fused_adamw_`` on bf16 p, g, m, v: what ``step()`` spends on it),
a K = 0 update pass over a stored gradient (``adamw_scaled``: what a step on CODA's kernel would run; ``coda.optim``'s
config and each ``--pass-configs`` entry) and CODA's dW GEMM with the AdamW epilogue (p, m, v updated in place) under
the heuristic config, ``coda.optim.update_config()`` and each ``--configs`` entry (fields as ``coda.bench.ncu``'s
``--config``: ``tm,tn,pp|coop,cm,static|dynamic,epi_n,stages|-``). The LM head's in-backward update is the K = 0 pass
over the dW its cross entropy formed, against the scaling pass plus torch's step. ``net`` = in-epilogue - (plain dW +
torch step): negative saves time. Medians of ``triton.testing.do_bench`` (L2 flushed), ms.
"""
from __future__ import annotations

import argparse
import sys

from .expand_ncu import parse_variant as parse  # the config arguments' format

SHAPES = {  # name: (N, K, epilogue kind); T tokens = batch x seq
    "llama-1b": {"gate_up": (16384, 2048, "fold"), "down": (2048, 8192, "plain"), "qkv": (3072, 2048, "plain"),
                 "o": (2048, 2048, "plain"), "lm_head": (128256, 2048, "scaled")},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--configs", nargs="*", default=[])
    ap.add_argument("--pass-configs", nargs="*", default=[],
                    help="configs of the K = 0 update pass over a stored gradient (besides coda.optim's)")
    args = ap.parse_args(argv)
    import torch
    from triton.testing import do_bench

    import coda
    from coda.epilogues.adamw import HYPER, adamw, adamw_fold, adamw_scaled
    from coda.epilogues.cross_entropy import scale_by
    from coda.ops._common import epilogue_pass
    from coda.optim import update_config

    def ms(fn):
        return do_bench(fn, warmup=25, rep=100)

    T = args.tokens
    bf = dict(device="cuda", dtype=torch.bfloat16)
    h = torch.tensor([0.9, 0.1, 0.95, 0.05, 1.2, 1e-8, 1e-4, 1.0], device="cuda").unsqueeze(1).repeat(1, 4)
    hyper = {n: h[i, :1] for i, n in enumerate(HYPER)}
    extra_cfgs = {c: parse(c) for c in args.configs}
    print(f"{torch.cuda.get_device_name()}, T = {T} tokens; ms (median)")
    total = {"replaced": 0.0, "best": 0.0}
    for name, (N, K, kind) in SHAPES[args.model].items():
        dy, x = torch.randn(T, N, **bf), torch.randn(T, K, **bf)
        p, m, v = torch.randn(N, K, **bf), torch.zeros(N, K, **bf), torch.zeros(N, K, **bf)
        g, gamma, s = torch.randn(N, K, **bf), torch.rand(K, device="cuda") + 0.5, torch.ones(1, device="cuda")
        step = torch.zeros((), device="cuda")
        t_torch = ms(lambda: torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.95,
                                                 weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False))
        ops = dict(p=p, m=m, v=v, **hyper)
        if kind == "scaled":  # the dW exists (the CE formed it): the scaling pass + torch's step vs one pass
            t_cublas = t_plain = ms(lambda: epilogue_pass(coda.gemm, g, N, K, epilogue=scale_by, out=g, t=g, s=s))

            def fused(cfg):
                return epilogue_pass(coda.gemm, g, N, K, epilogue=adamw_scaled, out=p, t=g, s=s, config=cfg, **ops)
        else:
            t_cublas = ms(lambda: dy.t() @ x)
            t_plain = ms(lambda: coda.gemm(dy.t(), x.t()))
            epi, extra = (adamw_fold, {"gamma": gamma}) if kind == "fold" else (adamw, {})

            def fused(cfg):
                return coda.gemm(dy.t(), x.t(), epilogue=epi, out=p, config=cfg, **extra, **ops)
        # a K = 0 update pass over this weight's stored gradient under coda.optim's config and each --pass-configs
        passes = []
        for label, cfg in {"coda.optim": update_config(k_zero=True),
                           **{c: parse(c) for c in args.pass_configs}}.items():
            try:
                t = ms(lambda: epilogue_pass(coda.gemm, g, N, K, epilogue=adamw_scaled, out=p, t=g, s=s, config=cfg,
                                             **ops))
                passes.append(f"{label} {t:.3f} ({14 * N * K / t / 1e6:.0f} GB/s)")
                step_best = t if label == "coda.optim" else min(step_best, t)
            except Exception as e:  # noqa: BLE001
                passes.append(f"{label}: {type(e).__name__}")
        total["torch_step"] = total.get("torch_step", 0.0) + t_torch
        total["pass_best"] = total.get("pass_best", 0.0) + step_best
        replaced = t_plain + t_torch
        row = []
        best = None
        # coda.optim's config (the dW GEMMs: epilogue warps), the K = 0 pass's 128 x 128 one, the heuristic's
        cfgs = {"heuristic": None, "coda.optim": update_config(kind == "scaled"),
                "128x128": update_config(k_zero=True), **extra_cfgs}
        for label, cfg in cfgs.items():
            try:
                fused(cfg)
                t = ms(lambda: fused(cfg))
            except Exception as e:  # noqa: BLE001 (a config the smem plan rejects)
                row.append(f"{label}: {type(e).__name__}")
                continue
            best = t if best is None else min(best, t)
            row.append(f"{label} {t:.3f} (net {t - replaced:+.3f})")
        total["replaced"] += replaced
        total["best"] += best if best is not None else replaced
        print(f"{name} {N}x{K}: cuBLAS dW {t_cublas:.3f}, CODA dW {t_plain:.3f}, torch AdamW step {t_torch:.3f} "
              f"({14 * N * K / t_torch / 1e6:.0f} GB/s); step pass: " + "; ".join(passes) + "; in-epilogue: "
              + "; ".join(row), flush=True)
        del dy, x, p, m, v, g
    print(f"sum (one layer + LM head): replaced {total['replaced']:.3f}, best in-epilogue {total['best']:.3f}; "
          f"torch steps {total['torch_step']:.3f}, best step passes {total['pass_best']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
