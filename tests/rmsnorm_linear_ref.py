"""coda.ops.rmsnorm_linear vs the unfused module in float64 (the truth), with the 2x rule against plain torch in the
input dtype; shared by tests/test_rmsnorm_linear.py (CPU) and tests/test_rmsnorm_linear_gpu.py (Hopper)."""
import torch

import coda.ops


def unfused(x, residual, gamma, weight, eps):
    """RMSNorm(h) @ weight.T, h = x (+ residual), in the leaves' dtype. Below float64 it is what a plain torch model
    does: statistics in fp32, the normed activation rounded to x's dtype, then the linear in x's dtype."""
    h = x if residual is None else x + residual
    if h.dtype == torch.float64:
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * gamma
    else:
        hf = h.float()
        n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * gamma.to(h.dtype)
    return n @ weight.T, h


def rel(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_against_fp64(lead, K, N, *, residual, device="cpu", dtype=torch.bfloat16, gamma_dtype=torch.float32,
                       eps=1e-6, floor=1e-4, seed=0):
    """Forward and every gradient (x, residual, norm_weight, weight) of the op vs float64 autograd of the unfused
    module: error(ours) <= 2 * error(plain torch in ``dtype``) + floor, each measured against float64."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x = rnd(*lead, K)
    res = rnd(*lead, K) if residual else None
    gamma = (1 + 0.5 * torch.randn(K, generator=g)).to(device=device, dtype=gamma_dtype)
    w = rnd(N, K, scale=K ** -0.5)
    dy, dh = rnd(*lead, N), rnd(*lead, K)  # upstream gradients of y and of the residual stream h

    def run(fn, fp64=False):
        leaves = [t.detach().to(torch.float64 if fp64 else t.dtype).requires_grad_()
                  for t in (x, gamma, w, res) if t is not None]
        y, h = fn(*leaves)
        h = h if residual else None
        outs, ups = ((y, h), (dy.to(y.dtype), dh.to(y.dtype))) if residual else ((y,), (dy.to(y.dtype),))
        grads = torch.autograd.grad(outs, leaves, ups)
        return dict(zip(["y", "h", "dx", "dgamma", "dweight", "dresidual"], [y, h, *grads]))

    def ours(x_, gamma_, w_, res_=None):
        out = coda.ops.rmsnorm_linear(x_, gamma_, w_, eps=eps, residual=res_)
        return out if residual else (out, None)

    def plain(x_, gamma_, w_, res_=None):
        return unfused(x_, res_, gamma_, w_, eps)

    got, want, theirs = run(ours), run(plain, fp64=True), run(plain)
    assert got["y"].shape == (*lead, N) and got["y"].dtype == dtype
    assert got["dgamma"].dtype == gamma_dtype and got["dweight"].shape == (N, K)
    report = {}
    for k in want:
        if want[k] is None:
            continue
        e_ours, e_torch = rel(got[k], want[k]), rel(theirs[k], want[k])
        report[k] = (e_ours, e_torch)
        assert e_ours <= 2 * e_torch + floor, (k, e_ours, e_torch)
    return report
