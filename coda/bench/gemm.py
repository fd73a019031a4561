"""Time CODA's GEMM against cuBLAS (torch.mm) in the same process: ``python -m coda.bench.gemm [--quick]``.

For each shape, every candidate config is timed (do_bench median, inputs rotated so that A/B come from HBM) and the
best is reported next to cuBLAS, with TFLOP/s and the ratio ours / cuBLAS.
"""
from __future__ import annotations

import argparse
import json

import torch

SHAPES = [(8192, 8192, 8192), (8192, 4096, 4096), (8192, 28672, 4096), (8192, 4096, 14336), (8192, 128256, 4096)]


def candidates():
    from ..config import GemmConfig
    out = []
    for tm, tn, pp in [(128, 256, False), (256, 128, False), (128, 128, True), (64, 256, True)]:
        for cm, cn in [(1, 1), (2, 1), (1, 2)]:
            for raster in ("m", "n"):
                c = GemmConfig(tile_m=tm, tile_n=tn, pingpong=pp, cluster_m=cm, cluster_n=cn, raster=raster)
                if not c.problems():
                    out.append(c)
    return out


def sweep():
    """Second-order knobs (swizzle group, epilogue sub-tile) around the best first-order configs."""
    from ..config import GemmConfig
    base = [dict(tile_m=128, tile_n=256, cluster_m=2, cluster_n=1, raster="n"),
            dict(tile_m=128, tile_n=256, cluster_m=1, cluster_n=2, raster="m"),
            dict(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2, raster="m")]
    return [GemmConfig(**b, swizzle=sw, epi_n=en) for b in base for sw in (1, 4, 16) for en in (32, 64)]


def bench(fn, rep_ms=200):
    from triton.testing import do_bench
    return do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


def median_of_runs(fn, runs: int = 3, rep_ms: int = 50) -> float:
    """The median over ``runs`` do_bench runs (each itself a median) after one call of ``fn`` outside them (a
    compile or first-use cost stays out): the session-19 benchmarks' timing."""
    from triton.testing import do_bench
    fn()
    return sorted(do_bench(fn, warmup=10, rep=rep_ms) for _ in range(runs))[runs // 2]


def event_times(fn, count: int = 0, secs: float = 0.0, pause: float = 0.0) -> list:
    """CUDA-event times (ms) of back-to-back calls of ``fn``: ``count`` of them, or as many as ``secs`` seconds
    take; with ``pause``, the GPU idles that many seconds before each (read after one synchronize at the end)."""
    import time
    out = []
    t0 = time.time()
    while len(out) < count or (not count and time.time() - t0 < secs):
        if pause:
            torch.cuda.synchronize()
            time.sleep(pause)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        out.append((e0, e1))
    torch.cuda.synchronize()
    return [x.elapsed_time(y) for x, y in out]


def sustained_ms(fn, secs: float = 2.0, warm: float = 1.0) -> float:
    """The median of ``fn``'s CUDA-event times over ``secs`` seconds of back-to-back calls after ``warm`` seconds
    of them: the power-capped (sustained) time, where do_bench's short bursts see boost clocks
    (docs/experiments/overlap_probe.py, attn_overlap.py)."""
    fn()
    event_times(fn, secs=warm)
    ts = sorted(event_times(fn, secs=secs))
    return ts[len(ts) // 2]


def main(argv=None):
    import coda
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help="M,N,K;M,N,K;...")
    ap.add_argument("--configs", default=None, help="indices into the candidate list, comma separated")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    shapes = SHAPES if not args.shapes else [tuple(map(int, s.split(","))) for s in args.shapes.split(";")]
    cands = sweep() if args.sweep else candidates()
    if args.configs:
        cands = [cands[int(i)] for i in args.configs.split(",")]
    rows = []
    for M, N, K in shapes:
        nbuf = max(1, min(4, int(2e9 // ((M + N) * K * 2))))
        As = [torch.randn(M, K, device="cuda", dtype=dtype) for _ in range(nbuf)]
        Bs = [torch.randn(N, K, device="cuda", dtype=dtype) for _ in range(nbuf)]
        out = torch.empty(M, N, device="cuda", dtype=dtype)
        it = [0]

        def rot():
            it[0] = (it[0] + 1) % nbuf
            return As[it[0]], Bs[it[0]]

        flops = 2 * M * N * K
        def cublas():
            a, b = rot()
            return torch.mm(a, b.T, out=out)

        t_cublas = bench(cublas)
        res = []
        for cfg in cands:
            try:
                coda.gemm(As[0], Bs[0], out=out, config=cfg)
                t = bench(lambda: coda.gemm(*rot(), out=out, config=cfg))
            except Exception as e:  # report, keep going
                print(f"  {cfg.name}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            res.append((t, cfg.name))
            print(f"  {M}x{N}x{K} {cfg.name + '_e' + str(cfg.epi_n):32s} {t:8.3f} ms {flops / t / 1e9:7.1f} TFLOP/s  x{t / t_cublas:.3f}",
                  flush=True)
        t_cublas2 = bench(cublas)
        print(f"  cuBLAS before/after: {t_cublas:.3f} / {t_cublas2:.3f} ms", flush=True)
        t_cublas = min(t_cublas, t_cublas2)
        res.sort()
        best_t, best_name = res[0]
        row = dict(M=M, N=N, K=K, cublas_ms=t_cublas, cublas_tflops=flops / t_cublas / 1e9, coda_ms=best_t,
                   coda_tflops=flops / best_t / 1e9, ratio=best_t / t_cublas, config=best_name)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'shape':>20s} {'cuBLAS ms':>10s} {'TFLOP/s':>8s} {'CODA ms':>9s} {'TFLOP/s':>8s} {'ratio':>6s}  config")
    for r in rows:
        print(f"{r['M']}x{r['N']}x{r['K']:>6} {r['cublas_ms']:10.3f} {r['cublas_tflops']:8.1f} {r['coda_ms']:9.3f} "
              f"{r['coda_tflops']:8.1f} {r['ratio']:6.3f}  {r['config']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
