"""coda.ops.rmsnorm vs Llama's RMSNorm in float64 (the truth), with the 2x rule against plain torch in the input
dtype; shared by tests/test_rmsnorm.py (CPU) and tests/test_rmsnorm_gpu.py (Hopper)."""
import torch

import coda.ops


def llama_rmsnorm(x, gamma, eps):
    """What a plain torch Llama does: statistics in fp32, x r rounded to x's dtype, then times gamma in x's dtype
    (float64 throughout for float64 leaves)."""
    if x.dtype == torch.float64:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * gamma.to(x.dtype)


def rel(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_against_fp64(lead, K, *, device="cpu", dtype=torch.bfloat16, gamma_dtype=torch.float32, eps=1e-6,
                       floor=1e-4, seed=0, scale=1.0):
    """n, dx and dgamma of the op vs float64 autograd: error(ours) <= 2 * error(plain torch in ``dtype``) + floor."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(*lead, K, generator=g) * scale).to(device=device, dtype=dtype)
    gamma = (1 + 0.5 * torch.randn(K, generator=g)).to(device=device, dtype=gamma_dtype)
    dn = torch.randn(*lead, K, generator=g).to(device=device, dtype=dtype)

    def run(fn, cast=None):
        xs = x.detach().clone() if cast is None else x.detach().to(cast)
        gs = gamma.detach().clone() if cast is None else gamma.detach().to(cast)
        xs.requires_grad_(True)
        gs.requires_grad_(True)
        n = fn(xs, gs, eps)
        n.backward(dn if cast is None else dn.to(cast))
        return n.detach(), xs.grad, gs.grad

    ref = run(llama_rmsnorm, torch.float64)
    torch_ = run(llama_rmsnorm)
    ours = run(coda.ops.rmsnorm)
    assert ours[0].dtype == dtype and ours[0].shape == x.shape
    assert ours[1].dtype == dtype and ours[2].dtype == gamma_dtype
    for name, o, t, r in zip(("n", "dx", "dgamma"), ours, torch_, ref):
        assert torch.isfinite(o).all(), name
        e_o, e_t = rel(o, r), rel(t, r)
        assert e_o <= 2 * e_t + floor, f"{name}: ours {e_o:.3e} vs torch {dtype} {e_t:.3e}"
    return ours
