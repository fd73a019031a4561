"""``python -m coda.bench.kzero [--M 8192] [--I 8192]``: the K = 0 passes of a fused llama step (CODA's kernel
running only its epilogue) under several configs, against the copy bandwidth (``torch`` clone of the same bytes) and
torch.compile of the same math (what stock + compile runs). Pass: the backward of ``ops.mlp.rms_swiglu`` on the
saved pre-activation (reads g, u, da; writes dacc interleaved and d_r), the step's largest (0.28 ms per layer on the
H100, session 19)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", type=int, default=8192)
    ap.add_argument("--I", type=int, default=8192)
    args = ap.parse_args(argv)
    import torch
    from .gemm import median_of_runs as bench

    import coda
    from coda.autodiff import DGRAD, grad_name
    from coda.config import GemmConfig
    from coda.ops._common import epilogue_pass
    from coda.ops.linear import backward_of
    from coda.ops.mlp import rms_swiglu

    M, I = args.M, args.I
    bf = dict(device="cuda", dtype=torch.bfloat16)
    g, u, da = (torch.randn(M, I, **bf) for _ in range(3))
    r = torch.rand(M, device="cuda", dtype=torch.float32) + 0.5
    prog = backward_of(rms_swiglu, ("out",), ("r",), False, preact=True)
    names = [o.name for o in prog.operands]
    ops = {grad_name("out"): da, "r": r}
    tiles = [n for n in names if n not in ops]
    ops.update(zip(tiles, (g, u)))

    def run(cfg=None):
        return epilogue_pass(coda.gemm, g, M, 2 * I, epilogue=prog, out_dtype=torch.bfloat16, config=cfg, **ops)

    moved = 3 * M * I * 2 + M * 2 * I * 2 + M * 4
    ref = run()
    rows = {"default": bench(run)}
    for name, cfg in {
        "128x256 coop 2x1 dyn st2": GemmConfig(tile_m=128, tile_n=256, cluster_m=2, sched="dynamic", stages=2),
        "128x256 coop 1x1 st2": GemmConfig(tile_m=128, tile_n=256, cluster_m=1, stages=2),
        "128x128 pp 1x1 st2": GemmConfig(tile_m=128, tile_n=128, cluster_m=1, pingpong=True, stages=2),
        "128x128 coop 1x1 st2": GemmConfig(tile_m=128, tile_n=128, cluster_m=1, stages=2),
        "64x256 pp 1x1 st2": GemmConfig(tile_m=64, tile_n=256, cluster_m=1, pingpong=True, stages=2),
        "128x256 coop 1x1 st2 epi64": GemmConfig(tile_m=128, tile_n=256, cluster_m=1, stages=2, epi_n=64),
    }.items():
        if cfg.problems():
            continue
        try:
            got = run(cfg)
            ok = all(torch.equal(got[k], ref[k]) for k in ref) if isinstance(ref, dict) else torch.equal(got, ref)
            rows[name] = bench(lambda: run(cfg)) if ok else float("nan")
        except Exception as e:  # noqa: BLE001 (a config the smem plan rejects)
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    big = torch.empty(moved // 2, **bf)
    t_copy = bench(lambda: big.clone()) / 2  # a clone reads and writes: half the time per byte moved once

    def torch_math(g, u, da, r):
        gr, ur = g.float() * r[:, None], u.float() * r[:, None]
        s = torch.sigmoid(gr)
        dgr = da.float() * ur * s * (1 + gr * (1 - s))
        dur = da.float() * gr * s
        dacc = torch.stack((dgr * r[:, None], dur * r[:, None]), -1).reshape(M, 2 * I).to(torch.bfloat16)
        d_r = (dgr * g.float() + dur * u.float()).sum(1)
        return dacc, d_r
    comp = torch.compile(torch_math)
    t_comp = bench(lambda: comp(g, u, da, r))
    print(f"{torch.cuda.get_device_name()}  M={M} I={I}: {moved / 1e6:.0f} MB moved; copy bandwidth "
          f"{moved / t_copy / 1e6:.0f} GB/s ({t_copy:.3f} ms); torch.compile {t_comp:.3f} ms")
    for k, t in rows.items():
        print(f"  {k:28s} {t:.3f} ms  {moved / t / 1e6:5.0f} GB/s  {t / t_comp:.3f}x compile")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def fused_sweep(M=8192, H=2048, I=8192, variants=None):
    """``python -c 'from coda.bench.kzero import fused_sweep; fused_sweep()'`` (``variants``: [(tile_m, tile_n,
    pingpong, cluster_m, sched, epi_n, stages)], default a grid): the SwiGLU backward fused into da's
    GEMM (``ops.mlp.dacc_on_da``) under tile / epi_n / stage variants (each with its TileMN ring depth and stages
    from ``smem_plan``), against cuBLAS's da GEMM + the K = 0 pass it replaces."""
    import itertools

    import torch
    from .gemm import median_of_runs as bench

    import coda
    from coda.config import GemmConfig
    from coda.kernels.epilogue import smem_plan
    from coda.ops._common import epilogue_pass
    from coda.ops.linear import backward_of
    from coda.ops.mlp import dacc_on_da, rms_swiglu

    bf = dict(device="cuda", dtype=torch.bfloat16)
    dy, wd, g, u = torch.randn(M, H, **bf), torch.randn(H, I, **bf), torch.randn(M, I, **bf), torch.randn(M, I, **bf)
    r = torch.rand(M, device="cuda") + 0.5
    which = (("out",), ("r",), False)
    prog, k0 = dacc_on_da(which), backward_of(rms_swiglu, *which, preact=True)
    ops = dict(r=r, _preact_even=g, _preact_odd=u)
    t_mm = bench(lambda: torch.mm(dy, wd))
    da = torch.mm(dy, wd)
    t_k0 = bench(lambda: epilogue_pass(coda.gemm, g, M, 2 * I, epilogue=k0, grad_out=da, **ops))
    print(f"{torch.cuda.get_device_name()} M={M} H={H} I={I}: cuBLAS da {t_mm:.3f} + K=0 pass {t_k0:.3f} = "
          f"{t_mm + t_k0:.3f} ms", flush=True)
    rows = [("default", None)]
    grid = [(v[:5], v[5], v[6]) for v in variants] if variants else itertools.product(
            [(128, 256, False, 2, "dynamic"), (128, 256, False, 1, "static"), (128, 128, True, 1, "static"),
             (128, 128, True, 2, "static"), (128, 128, False, 2, "dynamic")], (16, 32), (None, 3, 2))
    for (tm, tn, pp, cm, sched), en, st in grid:
        cfg = GemmConfig(tile_m=tm, tile_n=tn, pingpong=pp, cluster_m=cm, sched=sched, epi_n=en, stages=st)
        if not cfg.problems():
            rows.append((cfg.name + f"_e{en}_s{st}", cfg))
    for name, cfg in rows:
        try:
            t = bench(lambda: coda.gemm(dy, wd.t(), epilogue=prog, config=cfg, **ops))
            plan = "" if cfg is None else smem_plan(prog, cfg, [2], [2, 2], [True, True])
            plan = plan and f"ring {plan.ring} stages {plan.stages} bufs {plan.epi_buffers}"
            print(f"  {name:34s} {t:.3f} ms  {t / t_mm:.3f}x cuBLAS da  {t / (t_mm + t_k0):.3f}x da+pass  {plan}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  {name:34s} {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)


def unrotate_sweep(M=8192, N=3072):
    """RoPE's backward pass (``ops.rope.unrotate``: dy's even / odd columns copied out, then the K = 0 rotation by
    -theta) against the K = 0 pass alone (the copies made beforehand) and a plain clone of dy: where its time goes.
    ``python -c 'from coda.bench.kzero import unrotate_sweep; unrotate_sweep()'``; ms, one GPU."""
    import torch

    import coda
    from coda.autodiff import grad_name
    from coda.epilogues.rope import rope
    from coda.ops._common import epilogue_pass
    from coda.ops.linear import backward_of
    from coda.ops.rope import ODD_OUT, unrotate

    from .gemm import median_of_runs as bench
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(M, device="cuda", dtype=torch.float32) % 4096
    freqs = torch.rand(N // 2, device="cuda", dtype=torch.float32)
    bwd = backward_of(rope, ("out",), ())
    grads = {grad_name("out"): dy[:, 0::2].contiguous(), grad_name(ODD_OUT): dy[:, 1::2].contiguous()}

    def pass_only():
        return epilogue_pass(coda.gemm, dy, M, N, epilogue=bwd, out_dtype=dy.dtype, pos=pos, freq=freqs, **grads)

    assert torch.equal(pass_only(), unrotate(coda.gemm, dy, pos, freqs))
    out = {"unrotate": bench(lambda: unrotate(coda.gemm, dy, pos, freqs)), "K = 0 pass alone": bench(pass_only),
           "clone of dy": bench(dy.clone)}
    print(torch.cuda.get_device_name(), f"{M}x{N}", {k: round(v, 4) for k, v in out.items()})
    return out
