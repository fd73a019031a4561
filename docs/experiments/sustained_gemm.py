"""GEMM throughput and power under sustained load: cuBLAS vs coda.gemm (shipped config or heuristic).

The training step is power-capped on the H100 (700 W; the SM clock falls from 1980 to 1400-1700 MHz within a few
back-to-back steps: docs/experiments/step_clocks.py), so a kernel's energy per FLOP sets its speed in the step,
not its time in a short do_bench. Each (shape, kernel) runs back to back for --secs seconds; TFLOP/s over the
second half, mean power and SM clock over the same window (nvidia-smi sampled every 50 ms).
Usage on the GPU: python docs/experiments/sustained_gemm.py [--secs 3] [--shapes M,N,K ...] [--configs CFG ...]
(``--configs``: coda.gemm under each config, fields as ``coda.bench.ncu``'s ``--config``, instead of the shipped
one; cuBLAS runs before each, so the ratios are paired). ``--problems NAME ...`` (session 37): the fused problems of
``coda.bench.epi_wg`` (fused_da, swiglu_fwd, radial, adamw, logits, ...) under their default config, each paired with
cuBLAS's plain GEMM of the shape, plus the energy per call (mean W x s per call): under the power cap a fused kernel
pays off in the step only if it costs less energy than the plain GEMM plus the pass it replaces, not if it is merely
faster in a short do_bench (session 37: the logits GEMM 7 % faster alone, no change in the step)."""
import argparse
import time

import torch

import coda
from coda.bench import power

ap = argparse.ArgumentParser()
ap.add_argument("--secs", type=float, default=3.0)
ap.add_argument("--shapes", nargs="*", default=[])
ap.add_argument("--configs", nargs="*", default=[])
ap.add_argument("--problems", nargs="*", default=[])
args = ap.parse_args()

sampler = power.Sampler(power.smi_id(torch.cuda.current_device()))
SHAPES = ([tuple(int(v) for v in s.split(",")) for s in args.shapes]
          or [(8192, 16384, 2048), (8192, 2048, 8192), (8192, 8192, 8192), (8192, 128256, 2048)])


def run(fn, flops):
    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    n, half = 0, None
    while time.time() - t0 < args.secs:
        for _ in range(5):
            fn()
        n += 5
        torch.cuda.synchronize()
        if half is None and time.time() - t0 > args.secs / 2:
            half, n, th = time.time(), 0, time.time()
    dt = time.time() - th
    got = power.window(sampler.samples, th, time.time()) or {"w": 0.0, "mhz": 0.0}
    return n * flops / dt / 1e12, got["mhz"], got["w"]


time.sleep(1.0)
print(f"{torch.cuda.get_device_name()}: sustained {args.secs} s per kernel (TFLOP/s, MHz, W over the second half)")
if args.problems:
    from coda.bench.epi_wg import problems
    for name in args.problems:
        make, epi = problems()[name]
        a, b, ops, cublas = make()
        ops = {k: v for k, v in ops.items() if k in {o.name for o in epi.operands}}
        kw = {"out": ops["p"]} if "p" in ops else {}  # an in-place update keeps updating (its cost, not its values)
        flops = 2 * a.shape[0] * b.shape[0] * a.shape[1]
        res = {}
        for label, fn in (("cublas", cublas), ("fused", lambda: coda.gemm(a, b, epilogue=epi, **kw, **ops))):
            time.sleep(1.0)
            res[label] = run(fn, flops)
        (tc, mc, wc), (tf, mf, wf) = res["cublas"], res["fused"]
        jc, jf = wc * flops / (tc * 1e12), wf * flops / (tf * 1e12)  # W x seconds per call
        print(f"{name}: cuBLAS plain {tc:.0f} TF/s {mc:.0f} MHz {wc:.0f} W {jc:.3f} J/call; fused {tf:.0f} TF/s "
              f"{mf:.0f} MHz {wf:.0f} W {jf:.3f} J/call; time ratio {tc / tf:.3f}, energy ratio {jf / jc:.3f}",
              flush=True)
        del a, b, ops
    SHAPES = SHAPES if args.shapes else []
for M, N, K in SHAPES:
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    flops = 2 * M * N * K
    res = {}
    if args.configs:
        from coda.bench.expand_ncu import parse_variant
        for c in args.configs:
            time.sleep(1.0)
            base = run(lambda: torch.mm(a, b.t(), out=out), flops)
            time.sleep(1.0)
            cfg = parse_variant(c)
            t, mhz, w = run(lambda: coda.gemm(a, b, out=out, config=cfg), flops)
            print(f"{M}x{N}x{K} {c}: {t:.0f} TF/s {mhz:.0f} MHz {w:.0f} W; cuBLAS before it {base[0]:.0f} TF/s "
                  f"{base[1]:.0f} MHz {base[2]:.0f} W; ratio {t / base[0]:.3f}", flush=True)
        continue
    for name, fn in (("cublas", lambda: torch.mm(a, b.t(), out=out)), ("coda", lambda: coda.gemm(a, b, out=out)),
                     ("cublas2", lambda: torch.mm(a, b.t(), out=out)), ("coda2", lambda: coda.gemm(a, b, out=out))):
        time.sleep(1.0)  # cool down between kernels
        res[name] = run(fn, flops)
    print(f"{M}x{N}x{K}: " + "  ".join(f"{k} {t:.0f} TF/s {mhz:.0f} MHz {w:.0f} W" for k, (t, mhz, w) in res.items())
          + f"  coda/cublas {res['coda'][0] / res['cublas'][0]:.3f} {res['coda2'][0] / res['cublas2'][0]:.3f}")
