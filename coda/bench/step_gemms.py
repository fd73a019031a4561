"""``python -m coda.bench.step_gemms [--tune NAMES]``: the GEMMs of a fused llama-1b training step (B x T = 8192 tokens), plain: coda.gemm (heuristic config) vs cuBLAS,
in the operand layouts the ops use (forward: both K-major; dX: W^T MN-major; dW: both MN-major).
H200, b81eff5: sum over the 11 shapes 10.078 ms vs cuBLAS 10.097 (0.998); tuning three of them changed < 2 %."""
import sys
import torch
from triton.testing import do_bench
import coda

M = 8192
SHAPES = [  # name, M, N, K, layout
    ("qkv fwd", M, 3072, 2048, "fwd"), ("qkv dX", M, 2048, 3072, "dx"), ("qkv dW", 3072, 2048, M, "dw"),
    ("o fwd", M, 2048, 2048, "fwd"),
    ("gate/up fwd", M, 16384, 2048, "fwd"), ("mlp dX", M, 2048, 16384, "dx"), ("mlp dW", 16384, 2048, M, "dw"),
    ("down fwd", M, 2048, 8192, "fwd"),
    ("ce fwd chunk", 2816, 128256, 2048, "fwd"), ("ce dX chunk", 2816, 2048, 128256, "dx"),
    ("ce dW chunk", 128256, 2048, 2816, "dw"),
]


def operands(m, n, k, layout):
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    if layout == "fwd":
        return r(m, k), r(n, k)
    if layout == "dx":   # a = dy (m, k) K-major; b = W^T view: W is (k, n), b = W.t() (n, k) MN-major
        return r(m, k), r(k, n).t()
    return r(k, m).t(), r(k, n).t()  # dW = dy^T x: a = dy.t(), b = x.t()


def main() -> None:
    tot_c = tot_t = 0.0
    print(f"{torch.cuda.get_device_name()}  coda.gemm (CODA_AUTOTUNE={__import__('os').environ.get('CODA_AUTOTUNE')}) vs torch.mm")
    for name, m, n, k, lay in SHAPES:
        a, b = operands(m, n, k, lay)
        coda.gemm(a, b)
        tc = sorted(do_bench(lambda: coda.gemm(a, b), warmup=20, rep=100) for _ in range(3))[1]
        tt = sorted(do_bench(lambda: torch.mm(a, b.t()), warmup=20, rep=100) for _ in range(3))[1]
        f = 2 * m * n * k
        tot_c += tc; tot_t += tt
        print(f"{name:14s} {m:6d}x{n:6d}x{k:6d} {lay:3s}  coda {tc:7.3f} ms {f / tc / 1e9:5.0f} TF/s  cublas {tt:7.3f} ms "
              f"{f / tt / 1e9:5.0f} TF/s  ratio {tc / tt:.3f}", flush=True)
    print(f"sum: coda {tot_c:.3f} ms, cublas {tot_t:.3f} ms, ratio {tot_c / tot_t:.3f}")

    if len(sys.argv) > 1 and sys.argv[1] == "--tune":  # tune the named shapes (quick level) and time again
        import coda.autotune as at
        for name, m, n, k, lay in SHAPES:
            if name not in sys.argv[2].split(","):
                continue
            a, b = operands(m, n, k, lay)
            res = at.tune(a, b, progress=False)
            tc = sorted(do_bench(lambda: coda.gemm(a, b), warmup=20, rep=100) for _ in range(3))[1]
            tt = sorted(do_bench(lambda: torch.mm(a, b.t()), warmup=20, rep=100) for _ in range(3))[1]
            print(f"tuned {name:14s} best {getattr(res, 'best', None)}  coda {tc:.3f} ms  cublas {tt:.3f} ms  ratio {tc / tt:.3f}",
                  flush=True)


if __name__ == "__main__":  # importing the module (its operands) runs nothing
    main()
