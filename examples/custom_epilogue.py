"""A custom fused epilogue with @coda.epilogue: forward and (sympy-derived) backward, compared with torch.

    python examples/custom_epilogue.py            # on an H100: correctness + timings; elsewhere: sm_90a compile +
                                                  # the torch reference path
"""
import torch

import coda
import coda.ops


@coda.epilogue
def bias_gelu(acc, bias: coda.VecN):
    return coda.gelu(acc + bias)


@coda.epilogue
def out_and_sumsq(acc):
    return {"out": acc, "ss": coda.reduce_n(acc * acc)}


def torch_bias_gelu(x, w, b):
    return torch.nn.functional.gelu(torch.nn.functional.linear(x, w) + b, approximate="tanh")


def check(M, N, K, dev):
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5).requires_grad_()
    b = torch.randn(N, device=dev, requires_grad=True)
    y = coda.ops.linear(x, w, epilogue=bias_gelu, bias=b)
    g = torch.randn_like(y)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), g)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y64 = torch_bias_gelu(*leaves)
    r = torch.autograd.grad(y64, leaves, g.double())
    for name, got, ref in zip(("y", "dx", "dw", "db"), (y, dx, dw, db), (y64, *r)):
        err = ((got.double() - ref).norm() / ref.norm()).item()
        print(f"  {name}: relative error vs float64 {err:.2e}")


def main():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("No Hopper (sm_90) GPU: compiling the fused kernels for sm_90a and checking the torch reference path.")
        from coda.check import compile_variant
        from coda.config import GemmConfig
        for epi in (bias_gelu, out_and_sumsq):
            row = compile_variant(GemmConfig(), epi)
            print(f"  {epi.name}: compiled={row['wgmma'] > 0} wgmma={row['wgmma']} spills={row['spill_bytes']}B "
                  f"in {row['seconds']:.1f}s")
        check(200, 136, 64, "cpu")
        return
    from triton.testing import do_bench
    check(1000, 776, 512, "cuda")
    M, N, K = 8192, 28672, 4096
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    b = torch.randn(N, device="cuda")
    compiled = torch.compile(torch_bias_gelu)
    t = {
        "cuBLAS GEMM": do_bench(lambda: torch.mm(x, w.T)),
        "CODA GEMM": do_bench(lambda: coda.gemm(x, w)),
        "CODA bias_gelu (fused)": do_bench(lambda: coda.gemm(x, w, epilogue=bias_gelu, bias=b)),
        "torch eager bias+gelu": do_bench(lambda: torch_bias_gelu(x, w, b)),
        "torch.compile bias+gelu": do_bench(lambda: compiled(x, w, b)),
        "CODA out + reduce_n(acc^2)": do_bench(lambda: coda.gemm(x, w, epilogue=out_and_sumsq)),
    }
    print(f"{M}x{N}x{K} bf16, do_bench medians:")
    for k, v in t.items():
        print(f"  {k:28s} {v:7.3f} ms   x{v / t['CODA GEMM']:.3f} of CODA GEMM   x{v / t['cuBLAS GEMM']:.3f} of cuBLAS")


if __name__ == "__main__":
    main()
