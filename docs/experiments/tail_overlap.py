"""Do the backward's dW GEMMs (with coda.optim's AdamW epilogue) leave SMs idle that a concurrent GEMM could use?
For each dW GEMM of a llama-1b layer and the product that follows it in the backward (stand-ins: plain GEMMs of the
same shapes), the median time of: each alone, both in order on one stream, both on two streams (the dW launched on
a side stream after the other is queued). ``serial - concurrent`` is what running dW on a side stream could win
(wave-quantisation tails, each kernel's ramp). Usage on the GPU: python docs/experiments/tail_overlap.py"""
import torch
from triton.testing import do_bench

import coda
from coda.epilogues.adamw import HYPER, adamw
from coda.optim import update_config

T, H, I, KV = 8192, 2048, 8192, 512
bf = dict(device="cuda", dtype=torch.bfloat16)
h = torch.tensor([0.9, 0.1, 0.95, 0.05, 1.2, 1e-8, 1e-4, 1.0], device="cuda").unsqueeze(1).repeat(1, 4)
hyper = {n: h[i, :1] for i, n in enumerate(HYPER)}


def dw(N, K):
    dy, x = torch.randn(T, N, **bf), torch.randn(T, K, **bf)
    p, m, v = torch.randn(N, K, **bf), torch.zeros(N, K, **bf), torch.zeros(N, K, **bf)
    cfg = update_config(False, (N, K))
    return lambda: coda.gemm(dy.t(), x.t(), epilogue=adamw, out=p, p=p, m=m, v=v, config=cfg, **hyper)


def mm(M, N, K):
    a, b, out = torch.randn(M, K, **bf), torch.randn(N, K, **bf), torch.empty(M, N, **bf)
    return lambda: coda.gemm(a, b, out=out)


side = torch.cuda.Stream()
PAIRS = {  # dW GEMM -> the product the backward runs next
    "down dW || gate/up dX": (dw(H, I), mm(T, H, 2 * I)),
    "gate/up dW || O dX + QKV-like dX": (dw(2 * I, H), mm(T, H, H + 2 * KV)),
    "qkv dW || next down dX": (dw(H + 2 * KV, H), mm(T, I, H)),
    "o dW || next down dX": (dw(H, H), mm(T, I, H)),
}
print(torch.cuda.get_device_name(), "ms (median of do_bench)")
for name, (a, b) in PAIRS.items():
    a(), b()

    def serial():
        b()
        a()

    def concurrent(dw_first):
        def run():
            side.wait_stream(torch.cuda.current_stream())  # dW's inputs (and its dX) are formed before both
            if not dw_first:
                b()
            with torch.cuda.stream(side):
                a()
            if dw_first:
                b()
            torch.cuda.current_stream().wait_stream(side)
        return run

    ta, tb = do_bench(a, rep=200), do_bench(b, rep=200)
    ts = do_bench(serial, rep=300)
    t1, t2 = do_bench(concurrent(True), rep=300), do_bench(concurrent(False), rep=300)
    print(f"{name}: dW {ta:.3f}, other {tb:.3f}, serial {ts:.3f}, concurrent dW first {t1:.3f} "
          f"({ts - t1:+.3f}), other first {t2:.3f} ({ts - t2:+.3f})", flush=True)
