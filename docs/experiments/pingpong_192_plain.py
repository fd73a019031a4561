"""Plain GEMMs of the llama-1b step (8192 tokens; the LM head in one chunk) on 128 x 192 ping-pong tiles (192 fp32
accumulators a consumer thread; session 37, before that variant was added to coda.config.all_configs) against the
config coda.gemm picks (shipped / heuristic) and cuBLAS, in the operand layouts the ops use. Medians of 3 do_bench runs, ms.
Usage on the GPU: python docs/experiments/pingpong_192_plain.py [VARIANT ...] (GemmConfig fields, e.g.
"tile_m=128,tile_n=192,pingpong=1,cluster_m=2,epi_n=32")."""
import sys

import torch
from triton.testing import do_bench

import coda
from coda.bench.step_gemms import operands
from coda.config import GemmConfig

M = 8192
SHAPES = [("qkv fwd", M, 3072, 2048, "fwd"), ("o fwd", M, 2048, 2048, "fwd"), ("gate/up fwd", M, 16384, 2048, "fwd"),
          ("down fwd", M, 2048, 8192, "fwd"), ("da", M, 8192, 2048, "dx"), ("mlp dX", M, 2048, 16384, "dx"),
          ("mlp dW", 16384, 2048, M, "dw"), ("down dW", 2048, 8192, M, "dw"), ("logits", M, 128256, 2048, "fwd"),
          ("lm dX", M, 2048, 128256, "dx"), ("lm dW", 128256, 2048, M, "dw")]
DEFAULT = ["tile_m=128,tile_n=192,pingpong=1,cluster_m=2,epi_n=32",
           "tile_m=128,tile_n=192,pingpong=1,cluster_m=1,epi_n=32"]


def parse(spec):
    kw = {k: (v if k in ("raster", "sched") else bool(int(v)) if k == "pingpong" else int(v))
          for k, v in (f.split("=") for f in spec.split(","))}
    return GemmConfig(**kw)


def med(fn):
    return sorted(do_bench(fn, warmup=20, rep=100) for _ in range(3))[1]


variants = {s: parse(s) for s in (sys.argv[1:] or DEFAULT)}
print(torch.cuda.get_device_name(), "ms; ratio to coda's default config")
tot = {}
for name, m, n, k, lay in SHAPES:
    a, b = operands(m, n, k, lay)
    ref = coda.gemm(a, b)
    t_cublas, t_def = med(lambda: torch.mm(a, b.t())), med(lambda: coda.gemm(a, b))
    row = [f"cuBLAS {t_cublas:.3f}", f"default {t_def:.3f}"]
    tot["cublas"] = tot.get("cublas", 0) + t_cublas
    tot["default"] = tot.get("default", 0) + t_def
    for label, cfg in variants.items():
        out = coda.gemm(a, b, config=cfg)
        assert torch.equal(out, ref) or (out.float() - ref.float()).abs().max() < 1e-2 * ref.float().abs().max()
        t = med(lambda: coda.gemm(a, b, config=cfg))
        tot[label] = tot.get(label, 0) + t
        row.append(f"{cfg.name} {t:.3f} ({t / t_def:.3f})")
    print(f"{name:12s} {m}x{n}x{k} {lay}: " + "; ".join(row), flush=True)
    del a, b, ref
print("sum: " + "; ".join(f"{k} {v:.3f}" for k, v in tot.items()))
