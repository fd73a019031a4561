"""coda.ops.mlp (the Llama MLP sub-block from two fused GEMMs) on the reference path vs float64 autograd."""
import pytest
import torch
import torch.nn.functional as F

import coda.ops


def _stock(x, gamma, wg, wu, wd, eps):
    xf = x.double()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()
    return xf + F.linear(F.silu(F.linear(n, wg.double())) * F.linear(n, wu.double()), wd.double())


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("lead", [(37,), (2, 13)])
def test_mlp_matches_float64(lead):
    g = torch.Generator().manual_seed(0)
    H, inter, eps = 64, 48, 1e-6
    x = torch.randn(*lead, H, generator=g).bfloat16().requires_grad_()
    gamma = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16().requires_grad_()
    wg, wu = (torch.randn(inter, H, generator=g) * H ** -0.5 for _ in range(2))
    wd = (torch.randn(H, inter, generator=g) * inter ** -0.5).bfloat16().requires_grad_()
    wg, wu = wg.bfloat16().requires_grad_(), wu.bfloat16().requires_grad_()
    y = coda.ops.mlp(x, gamma, coda.ops.interleave_gate_up(wg, wu), wd, eps)
    up = torch.randn(y.shape, generator=g, dtype=torch.float64)
    leaves = [x, gamma, wg, wu, wd]
    ours = torch.autograd.grad((y.double() * up).sum(), leaves)
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    y64 = _stock(*l64, eps)
    ref = torch.autograd.grad((y64 * up).sum(), l64)
    lbf = [t.detach().requires_grad_() for t in leaves]  # plain torch in bf16: the 2x rule's yardstick
    xb, gb, wgb, wub, wdb = lbf
    nb = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + eps)).bfloat16() * gb
    yb = xb + F.linear(F.silu(F.linear(nb, wgb)) * F.linear(nb, wub), wdb)
    theirs = torch.autograd.grad((yb.double() * up).sum(), lbf)
    assert _rel(y, y64) <= 2 * _rel(yb, y64) + 1e-4
    for name, o, r, t in zip(["x", "gamma", "w_gate", "w_up", "w_down"], ours, ref, theirs):
        assert _rel(o, r) <= 2 * _rel(t, r) + 1e-4, (name, _rel(o, r), _rel(t, r))


def test_mlp_errors():
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(ValueError, match="w_down"):
        coda.ops.mlp(x, torch.ones(64), torch.randn(96, 64).bfloat16(), torch.randn(64, 40).bfloat16())
    with pytest.raises(ValueError, match="w_gate_up"):
        coda.ops.mlp(x, torch.ones(64), torch.randn(95, 64).bfloat16(), torch.randn(64, 48).bfloat16())
    with pytest.raises(TypeError, match="norm_weight"):
        coda.ops.mlp(x, None, torch.randn(96, 64).bfloat16(), torch.randn(64, 48).bfloat16())
