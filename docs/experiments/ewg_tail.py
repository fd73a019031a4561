"""How long the epilogue warps take per tile (session 38): each epilogue-warp problem of the llama-1b step run at
K = 64 (the mainloop ~free: the kernel is epilogue-bound), ms / waves = E, the epilogue's time per tile; beside the
same kernel with the identity epilogue through the hand-off, and at the real K (the last tile's epilogue is exposed
after the mainloop ends: the kernel's excess over the plain GEMM is at least ~E). Usage on the GPU:
python docs/experiments/ewg_tail.py

Session 38 (H100, fastmath AdamW, CODA_AUTOTUNE=0), ms at K = 64 vs the identity hand-off (E per tile), then at the
real K: gate/up dW + AdamW fold 0.2896 vs 0.0384 (E 36.2 us, 8 waves), K 8192 0.7789 vs 0.7577; down dW + AdamW
0.0996 vs 0.0220 (E 24.9 us), K 8192 0.3887 vs 0.3932; gate/up fwd (SwiGLU) 0.3364 vs 0.1308 (E 10.5 us, 32 waves),
K 2048 0.7961 vs 0.7666; MLP dX (radial) 0.0809 vs 0.0219 (E 20.2 us), K 16384 0.7096 vs 0.7531. At the real K
each is within 3-4 % of its identity hand-off: the epilogue warps' work hides, the last tile's exposure is small."""
import torch
from triton.testing import do_bench

import coda
from coda.autodiff import with_preact
from coda.config import GemmConfig, epi_wg_config
from coda.epilogues.adamw import HYPER, adamw, adamw_fold
from coda.kernels.epilogue import IDENTITY
from coda.ops.mlp import rms_radial_residual, rms_swiglu

bf = dict(device="cuda", dtype=torch.bfloat16)
T, H, I = 8192, 2048, 8192
hyp = torch.tensor([0.9, 0.1, 0.95, 0.05, 1.2, 1e-8, 1e-4, 1.0], device="cuda").unsqueeze(1).repeat(1, 4)


def dw(rows, cols, k, fold):
    dacc, x = torch.randn(k, rows, **bf), torch.randn(k, cols, **bf)
    p = torch.randn(rows, cols, **bf)
    ops = dict(p=p, m=torch.zeros_like(p), v=torch.rand_like(p), out=p,
               **{n: hyp[i, :1] for i, n in enumerate(HYPER)})
    if fold:
        ops["gamma"] = torch.rand(cols, device="cuda") + 0.5
    return dacc.t(), x.t(), ops, (adamw_fold if fold else adamw), epi_wg_config()


def swiglu(k):
    x, w = torch.randn(T, k, **bf), torch.randn(2 * I, k, **bf)
    return x, w, dict(r=torch.rand(T, device="cuda") + 0.5), with_preact(rms_swiglu), \
        GemmConfig(cluster_m=1, cluster_n=2, epi_wg=True)


def radial(k):
    dacc, w = torch.randn(T, k, **bf), torch.randn(k, H, **bf)
    ops = dict(gamma=torch.rand(H, device="cuda") + 0.5, r=torch.rand(T, device="cuda") + 0.5,
               dr=torch.randn(T, device="cuda"), inv_h=1.0 / H, h=torch.randn(T, H, **bf), dres=torch.randn(T, H, **bf))
    return dacc, w.t(), ops, rms_radial_residual, GemmConfig(epi_wg=True)


PROBLEMS = {"gate/up dW + AdamW fold": lambda k: dw(2 * I, H, k, True),
            "down dW + AdamW": lambda k: dw(H, I, k, False),
            "gate/up fwd (SwiGLU)": swiglu, "MLP dX (radial)": radial}
REAL_K = {"gate/up dW + AdamW fold": T, "down dW + AdamW": T, "gate/up fwd (SwiGLU)": H, "MLP dX (radial)": 2 * I}

print(torch.cuda.get_device_name(), "ms (median); E = ms / waves at K = 64")
for name, make in PROBLEMS.items():
    row = []
    for k in (64, REAL_K[name]):
        a, b, ops, epi, cfg = make(k)
        M, N = a.shape[0], b.shape[0]
        waves = -(-(-(-M // cfg.tile_m) * -(-N // cfg.tile_n)) // 132)
        out_cols = epi.out_cols(N) if hasattr(epi, "out_cols") else N
        t = do_bench(lambda: coda.gemm(a, b, epilogue=epi, config=cfg, **ops), warmup=10, rep=50)
        t0 = do_bench(lambda: coda.gemm(a, b, epilogue=IDENTITY, config=cfg), warmup=10, rep=50)
        e = f" (E {1e3 * t / waves:.1f} us / tile, identity {1e3 * t0 / waves:.1f}, {waves} waves)"
        row.append(f"K {k}: {t:.4f} vs identity {t0:.4f}" + (e if k == 64 else ""))
        del a, b, ops
    print(f"{name}: " + "; ".join(row), flush=True)
