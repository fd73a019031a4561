"""The SwiGLU backward on stored factors instead of the pre-activation (issue 29's largest excess)?

Today the gate/up forward stores h = silu(g r) (u r) and the pre-activation g, u; the down dX GEMM's 1 -> 2 epilogue
reads g, u and forms dg, du and d_r's row partials: ~42 instructions and 2 MUFU an element (too heavy for the
epilogue warps; in the consumer warps its memory traffic is exposed). With G = g r, U = u r, s = sigmoid(G) the
forward could store instead A = r U s (1 + G (1 - s)), B = r G s and Q = (G A / r + h) / r (three M x I bf16 values
for two), and the backward becomes dg = da A, du = da B, d_r += da Q: trivial math, traffic that the epilogue warps
hide. Times (do_bench medians of 3, ms, 8192 tokens, H 2048, I 8192) of both forwards and both backwards under
several configs; the new forms checked against the old (relative max error). Usage on the GPU:
python docs/experiments/swiglu_factors.py"""
import torch

import coda
from coda.bench.gemm import median_of_runs
from coda.autodiff import with_preact
from coda.config import GemmConfig
from coda.dsl import DslEpilogue
from coda.kernels.epilogue import ODD_OUT
from coda.ops.mlp import dacc_on_da, rms_swiglu


@coda.epilogue
def rms_swiglu_factors(acc, r: coda.VecM):
    g, u = coda.pairs(acc)
    G, U = g * r, u * r
    s = coda.sigmoid(G)
    b = G * s
    h = b * U
    ap = U * s * (1 + G * (1 - s))
    return {"out": h, "fa": ap * r, "fb": b * r, "fq": (G * ap + h) / r}


@coda.epilogue
def _bwd(acc, fa: coda.TileMN, fb: coda.TileMN, fq: coda.TileMN):
    return {"out": acc * fa, "odd": acc * fb, "d_r": coda.reduce_n(acc * fq)}


swiglu_bwd_factors = DslEpilogue("swiglu_bwd_factors", _bwd.operands,
                                 {"out": _bwd.exprs["out"], ODD_OUT: _bwd.exprs["odd"]}, _bwd.red_specs, expand=True)


def ms(fn):
    return median_of_runs(fn, rep_ms=100)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


bf = dict(device="cuda", dtype=torch.bfloat16)
T, H, I = 8192, 2048, 8192
x, w = torch.randn(T, H, **bf), torch.randn(2 * I, H, **bf) / H ** 0.5
r = torch.rand(T, device="cuda") + 0.5
dy, wd = torch.randn(T, H, **bf), torch.randn(H, I, **bf)
print(torch.cuda.get_device_name(), "ms", flush=True)
FWD = {"shipped": None, "ewg c2": GemmConfig(epi_wg=True), "ewg c1x2": GemmConfig(epi_wg=True, cluster_m=1,
                                                                                   cluster_n=2),
       "coop c2": GemmConfig()}
old_f = with_preact(rms_swiglu)
ref = coda.gemm(x, w, epilogue=old_f, r=r)
new = coda.gemm(x, w, epilogue=rms_swiglu_factors, r=r)
print(f"forward: h err {rel(new['out'], ref['out']):.1e}", flush=True)
for name, cfg in FWD.items():
    t_old = ms(lambda: coda.gemm(x, w, epilogue=old_f, r=r, config=cfg))
    t_new = ms(lambda: coda.gemm(x, w, epilogue=rms_swiglu_factors, r=r, config=cfg))
    print(f"forward {name}: h, g, u {t_old:.3f}; h, A, B, Q {t_new:.3f}", flush=True)
print(f"forward cuBLAS plain {ms(lambda: torch.mm(x, w.t())):.3f}", flush=True)

old_b = dacc_on_da((("out",), ("r",), False))
g, u = ref["_preact_even"], ref["_preact_odd"]
fac = dict(fa=new["fa"], fb=new["fb"], fq=new["fq"])
b_ref = coda.gemm(dy, wd.t(), epilogue=old_b, r=r, _preact_even=g, _preact_odd=u)
b_new = coda.gemm(dy, wd.t(), epilogue=swiglu_bwd_factors, **fac)
print(f"backward: dacc err {rel(b_new['out'], b_ref['out']):.1e}, d_r err "
      f"{rel(b_new['d_r'], b_ref[[k for k in b_ref if k != 'out'][0]]):.1e} (keys {list(b_ref)} / {list(b_new)})",
      flush=True)
BWD = {"shipped": None, "pp 64x256 c2": GemmConfig(tile_m=64, tile_n=256, pingpong=True), "coop c2": GemmConfig(),
       "ewg c2": GemmConfig(epi_wg=True), "ewg c1": GemmConfig(epi_wg=True, cluster_m=1)}
for name, cfg in BWD.items():
    t_old = ms(lambda: coda.gemm(dy, wd.t(), epilogue=old_b, r=r, _preact_even=g, _preact_odd=u, config=cfg))
    t_new = ms(lambda: coda.gemm(dy, wd.t(), epilogue=swiglu_bwd_factors, config=cfg, **fac))
    print(f"backward {name}: on g, u {t_old:.3f}; on A, B, Q {t_new:.3f}", flush=True)
print(f"backward cuBLAS plain {ms(lambda: torch.mm(dy, wd)):.3f}", flush=True)
