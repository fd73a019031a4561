"""4-CTA clusters (4 x 1 / 1 x 4: the B / A tile multicast to four CTAs): less L2 traffic a FLOP.

The fused SwiGLU backward hides its epilogue under the other warpgroup's mainloop at 64 x 256 ping-pong, but the
64-row tiles' mainloop is L2-bound (session 33: 14 % slower than 128 x 256 cooperative). With B multicast over four
M-adjacent CTAs a 64 x 256 tile loads (64 + 64) x 64 operand elements a k-step, as 128 x 256 at 2 x 1 does. Times
(do_bench medians of 3, ms) of plain GEMMs and the fused SwiGLU backward at 2- and 4-CTA clusters, cuBLAS beside,
each result checked against the 2 x 1 config's. Usage on the GPU: python docs/experiments/cluster4.py"""
import torch
from triton.testing import do_bench

import coda
from coda.config import GemmConfig
from coda.gemm import _max_active_clusters
from coda.ops.mlp import dacc_on_da

bf = dict(device="cuda", dtype=torch.bfloat16)


def ms(fn):
    fn()
    return sorted(do_bench(fn, rep=100) for _ in range(3))[1]


T, H, I = 8192, 2048, 8192
# plain GEMMs: (label, a, b) with b (N, K) as coda.gemm takes it
x, wgu, wd = torch.randn(T, H, **bf), torch.randn(2 * I, H, **bf), torch.randn(H, I, **bf)
dpre, hh, dy = torch.randn(T, 2 * I, **bf), torch.randn(T, I, **bf), torch.randn(T, H, **bf)
PLAIN = [("gate/up fwd 8192x16384x2048", x, wgu), ("down fwd 8192x2048x8192", hh, wd),
         ("gate/up dX 8192x2048x16384", dpre, wgu.t()), ("gate/up dW 16384x2048x8192", dpre.t(), x.t()),
         ("down dX 8192x8192x2048", dy, wd.t())]
coda.gemm(x, x)  # (the CUDA context, for the DSL's occupancy query)
print(torch.cuda.get_device_name(), "max active clusters of 1 / 2 / 4 CTAs:",
      [_max_active_clusters(s) for s in (1, 2, 4)], flush=True)
CFGS = {"128x256 c2x1": GemmConfig(), "128x256 c4x1": GemmConfig(cluster_m=4),
        "128x256 c1x4": GemmConfig(cluster_m=1, cluster_n=4), "256x128 c1x4": GemmConfig(tile_m=256, tile_n=128,
                                                                                       cluster_m=1, cluster_n=4)}
for label, a, b in PLAIN:
    ref = coda.gemm(a, b, config=CFGS["128x256 c2x1"])
    t_cb = ms(lambda: torch.mm(a, b.t()))
    row = []
    for name, cfg in CFGS.items():
        out = coda.gemm(a, b, config=cfg)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        row.append(f"{name} {ms(lambda: coda.gemm(a, b, config=cfg)):.3f} (err {err:.1e})")
    print(f"{label}: cuBLAS {t_cb:.3f}; " + "; ".join(row), flush=True)

fused_da = dacc_on_da((("out",), ("r",), False))
ops = dict(r=torch.rand(T, device="cuda") + 0.5, _preact_even=torch.randn(T, I, **bf),
           _preact_odd=torch.randn(T, I, **bf))
DA = {"64x256 pp c2x1 (shipped)": GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=2),
      "64x256 pp c4x1": GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=4),
      "64x256 pp c1x1": GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=1),
      "128x256 coop c4x1": GemmConfig(cluster_m=4), "128x256 coop c2x1": GemmConfig()}
base = None
for name, cfg in DA.items():
    res = coda.gemm(dy, wd.t(), epilogue=fused_da, config=cfg, **ops)
    out = res["out"] if isinstance(res, dict) else res[0] if isinstance(res, (tuple, list)) else res
    base = out if base is None else base
    err = ((out.float() - base.float()).abs().max() / base.float().abs().max()).item()
    t = ms(lambda: coda.gemm(dy, wd.t(), epilogue=fused_da, config=cfg, **ops))
    print(f"fused SwiGLU backward 8192x8192x2048 {name}: {t:.3f} ms (err vs shipped {err:.1e})", flush=True)
print(f"cuBLAS plain 8192x8192x2048: {ms(lambda: torch.mm(dy, wd)):.3f}")
