"""CODA quickstart: a plain GEMM and a fused GEMM + epilogue, against torch.

On a Hopper GPU: runs CODA's kernels, checks them against float64 and prints times next to cuBLAS / torch.
Elsewhere: says so, compiles the same kernels for sm_90a on the CPU, and checks the torch reference path.
"""
import time

import os

import torch

# the demo uses the heuristic config; `python -m coda.autotune --gemm M,N,K` tunes a shape once (~1 min) and
# every later process reuses the result
os.environ.setdefault("CODA_AUTOTUNE", "0")

import coda
from coda._device import hopper_available
from coda.epilogues.scale_bias import ScaleBiasSumsq
from coda.kernels.epilogue import IDENTITY


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def on_gpu():
    from triton.testing import do_bench
    M, N, K = 8192, 8192, 8192
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    y = coda.gemm(x, w)
    torch.cuda.synchronize()
    print(f"first call (compile + run): {time.time() - t0:.2f} s")
    ref = x.double() @ w.double().T
    print(f"plain GEMM {M}x{N}x{K}: rel err CODA {rel(y, ref):.2e}, torch {rel(x @ w.T, ref):.2e}")
    t_coda = do_bench(lambda: coda.gemm(x, w, out=y), return_mode="median")
    t_cublas = do_bench(lambda: torch.mm(x, w.T, out=y), return_mode="median")
    tf = 2 * M * N * K / 1e9
    print(f"  CODA {t_coda:.3f} ms ({tf / t_coda:.0f} TFLOP/s)   cuBLAS {t_cublas:.3f} ms ({tf / t_cublas:.0f} TFLOP/s)")

    scale, bias = torch.rand(M, device="cuda") + 0.5, torch.randn(N, device="cuda")
    epi = ScaleBiasSumsq()
    got = coda.gemm(x, w, epilogue=epi, scale=scale, bias=bias)
    want = epi.reference(ref, scale.double(), bias.double())
    print(f"fused scale+bias+row-sumsq: rel err out {rel(got['out'], want['out']):.2e}, "
          f"sumsq {rel(got['sumsq'], want['sumsq']):.2e}")

    def unfused():
        y = torch.mm(x, w.T) * scale[:, None].bfloat16() + bias.bfloat16()
        return y, y.float().square().sum(-1)
    t_fused = do_bench(lambda: coda.gemm(x, w, epilogue=epi, scale=scale, bias=bias), return_mode="median")
    t_torch = do_bench(unfused, return_mode="median")
    print(f"  fused CODA {t_fused:.3f} ms   torch eager (GEMM + 3 passes) {t_torch:.3f} ms")


def on_cpu():
    print("No Hopper (sm_90) GPU here: compiling the kernels for sm_90a on the CPU and checking the torch reference.")
    from coda.check import compile_variant
    from coda.config import default_config
    for epi in (IDENTITY, ScaleBiasSumsq()):  # the config coda.gemm picks for a large GEMM (CODA_AUTOTUNE=0)
        r = compile_variant(default_config(8192, 8192, 8192), epi)
        print(f"  compiled {r['config']} epilogue={r['epilogue']}: {r['seconds']:.2f} s, "
              f"{r['wgmma']} wgmma in the PTX, {r['registers']} registers, spills {r['spill_bytes']} B")
    x, w = torch.randn(127, 72, dtype=torch.bfloat16), torch.randn(200, 72, dtype=torch.bfloat16)
    scale, bias = torch.rand(127) + 0.5, torch.randn(200)
    got = coda.reference.gemm(x, w, epilogue=ScaleBiasSumsq(), scale=scale, bias=bias)
    acc = x.double() @ w.double().T
    want = ScaleBiasSumsq().reference(acc, scale.double(), bias.double())
    print(f"  reference path: rel err out {rel(got['out'], want['out']):.2e}, sumsq {rel(got['sumsq'], want['sumsq']):.2e}")


if __name__ == "__main__":
    on_gpu() if hopper_available() else on_cpu()
