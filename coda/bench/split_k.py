"""``python -m coda.bench.split_k``: few-tile, long-K GEMMs (the LM head's dX chunks, issue 29's shapes) timed as
coda.gemm's default, as fixed configs unsplit, as K-splits (one batched launch into fp32 partials, summed and cast,
what ``coda.gemm._split_k`` runs), as the in-kernel split-K (``GemmConfig.splits``: "sk{s}" at 128 x 256 tiles,
"sk{s}/128" at 128 x 128) and as cuBLAS, in one process (do_bench medians of 3; a result off the cuBLAS one by
more than 2 % of its largest magnitude prints as nan). Layout: the dX layout of the
ops (a K-major, b = W^T an MN-major view); ``--layout fwd`` for both K-major."""
from __future__ import annotations

import argparse
import sys

SHAPES = [(2816, 2048, 128256), (2560, 2048, 128256), (4096, 2048, 128256), (512, 512, 32768),
          (1024, 2816, 8192), (6144, 768, 16384),
          (1, 4096, 4096), (17, 4096, 4096), (64, 4096, 4096)]  # issue 29's small M: 16-32 tiles on 132 SMs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="dx", choices=("dx", "fwd"))
    ap.add_argument("--splits", default="2,3,4,6,8,16")
    ap.add_argument("--shapes", default=None, metavar="M,N,K[;M,N,K]", help="instead of the default list")
    args = ap.parse_args(argv)
    import torch
    from .gemm import median_of_runs as bench

    import coda
    from coda.config import GemmConfig, split_k
    from coda.gemm import split_k_views
    from coda.runtime.rules import split_reason

    cfgs = {"128x256 2x1 dyn": GemmConfig(tile_m=128, tile_n=256, cluster_m=2, cluster_n=1, sched="dynamic"),
            "128x256 1x1 dyn": GemmConfig(tile_m=128, tile_n=256, sched="dynamic"),
            "128x128 pp 2x1": GemmConfig(tile_m=128, tile_n=128, cluster_m=2, cluster_n=1, pingpong=True),
            "128x128 coop 1x1": GemmConfig(tile_m=128, tile_n=128)}
    big = cfgs["128x256 2x1 dyn"]
    print(torch.cuda.get_device_name(), "layout", args.layout)
    shapes = [tuple(map(int, x.split(","))) for x in args.shapes.split(";")] if args.shapes else SHAPES
    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) if args.layout == "fwd"
             else torch.randn(K, N, device="cuda", dtype=torch.bfloat16).t())
        ref = torch.mm(a, b.t())
        t_cub = bench(lambda: torch.mm(a, b.t()))
        row = {"default": bench(lambda: coda.gemm(a, b))}
        for name, c in cfgs.items():
            if not c.problems():
                row[name] = bench(lambda: coda.gemm(a, b, config=c))
        tol = 0.02 * ref.float().abs().max().item()

        def checked(run):  # its median, nan where the result is off cuBLAS's
            return bench(run) if (run().float() - ref.float()).abs().max().item() <= tol else float("nan")
        for s in map(int, args.splits.split(",")):
            if K % (s * 64):
                continue
            av, bv = split_k_views(a, s), split_k_views(b, s)
            row[f"split{s}"] = checked(lambda av=av, bv=bv: torch.sum(coda.gemm(av, bv, out_dtype=torch.float32,
                                                                              config=big), 0).to(torch.bfloat16))
            for tn in (256, 128):  # the in-kernel split-K
                c = GemmConfig(tile_n=tn, cluster_m=1, splits=s)
                if not (c.problems() or split_reason(c, K)):
                    row[f"sk{s}" + ("/128" if tn == 128 else "")] = checked(lambda c=c: coda.gemm(a, b, config=c))
        best = min(row, key=lambda k: row[k])
        print(f"{M}x{N}x{K}: cuBLAS {t_cub:.3f} ms; model split {split_k(M, N, K)}; "
              + ", ".join(f"{k} {v / t_cub:.3f}" for k, v in row.items()) + f"; best {best}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
