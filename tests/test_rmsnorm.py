"""coda.ops.rmsnorm on the CPU (the reference path: the same epilogue programs as torch ops): the backward's algebra
with sympy, forward and gradients vs float64 (2x rule), torch.library.opcheck, torch.compile, bad arguments."""
import pytest
import sympy as sp
import torch

import coda.ops
from coda.dsl import ACC, operand_symbol
from coda.ops.rmsnorm import rmsnorm_backward, rms_apply, rms_row_dot
from rmsnorm_ref import check_against_fp64

K = 3


def test_backward_identity():
    """dx and dgamma of L = <dn, n>, n = x r gamma, from the epilogues' own traced expressions."""
    x = [sp.Symbol(f"x{k}", real=True) for k in range(K)]
    g = [sp.Symbol(f"g{k}", real=True) for k in range(K)]
    dn = [sp.Symbol(f"d{k}", real=True) for k in range(K)]
    eps = sp.Symbol("eps", positive=True)
    r = 1 / sp.sqrt(sum(v ** 2 for v in x) / K + eps)
    sub = lambda e, **ops: e.subs({ACC: 0, **{operand_symbol(k): v for k, v in ops.items()}})  # noqa: E731
    n = [sub(rms_apply.exprs["out"], h=x[k], r=r, gamma=g[k]) for k in range(K)]
    assert all(sp.simplify(n[k] - x[k] * r * g[k]) == 0 for k in range(K))
    loss = sum(dn[k] * n[k] for k in range(K))
    s = sum(sub(rms_row_dot.red_specs["s"][2], dn=dn[k], h=x[k], gamma=g[k]) for k in range(K))
    c = r * s / K
    for k in range(K):
        got = sub(rmsnorm_backward.exprs["out"], dn=dn[k], h=x[k], r=r, c=c, gamma=g[k])
        assert sp.simplify(got - sp.diff(loss, x[k])) == 0
        dgamma = sub(rmsnorm_backward.red_specs["dgamma"][2], dn=dn[k], h=x[k], r=r)
        assert sp.simplify(dgamma - sp.diff(loss, g[k])) == 0


@pytest.mark.parametrize("lead,K", [((37,), 64), ((3, 11), 136), ((0,), 64)])
@pytest.mark.parametrize("gamma_dtype", [torch.float32, torch.bfloat16])
def test_against_fp64(lead, K, gamma_dtype):
    if lead == (0,):
        x = torch.randn(0, K, dtype=torch.bfloat16, requires_grad=True)
        g = torch.ones(K, requires_grad=True)
        coda.ops.rmsnorm(x, g).sum().backward()
        assert x.grad.shape == x.shape and torch.equal(g.grad, torch.zeros(K))
        return
    check_against_fp64(lead, K, gamma_dtype=gamma_dtype)


def test_fp16_and_large_values():
    check_against_fp64((29,), 72, dtype=torch.float16, gamma_dtype=torch.float16)
    check_against_fp64((29,), 72, scale=1e3)


def test_opcheck_and_compile():
    x = torch.randn(19, 40, dtype=torch.bfloat16)
    g = torch.rand(40)
    torch.library.opcheck(torch.ops.coda.rmsnorm.default, (x, g, 1e-6))
    torch._dynamo.reset()
    xs = x.clone().requires_grad_()
    f = torch.compile(lambda a, b: coda.ops.rmsnorm(a, b).float().square().sum(), fullgraph=True,
                      backend="aot_eager")
    gs = g.clone().requires_grad_()
    f(xs, gs).backward()
    xe, ge = x.clone().requires_grad_(), g.clone().requires_grad_()
    coda.ops.rmsnorm(xe, ge).float().square().sum().backward()
    torch.testing.assert_close(xs.grad, xe.grad)
    torch.testing.assert_close(gs.grad, ge.grad)


@pytest.mark.parametrize("args,exc,match", [
    ((torch.randn(4, 8), torch.ones(8)), TypeError, "x must be bfloat16 or float16"),
    ((torch.randn(4, 8, dtype=torch.bfloat16), torch.ones(7)), ValueError, "norm_weight must have shape"),
    ((torch.randn(4, 6, dtype=torch.bfloat16), torch.ones(6)), ValueError, "multiple of 8"),
    ((torch.randn(4, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.int32)), TypeError, "norm_weight"),
    (("x", torch.ones(8)), TypeError, "x must be a torch.Tensor"),
])
def test_bad_arguments_name_them(args, exc, match):
    with pytest.raises(exc, match=match):
        coda.ops.rmsnorm(*args)


def test_bad_eps():
    with pytest.raises(ValueError, match="eps"):
        coda.ops.rmsnorm(torch.randn(4, 8, dtype=torch.bfloat16), torch.ones(8), eps=0.0)


def test_sumsq_from_the_producer():
    """sumsq=: r from the given rows' sums of squares: the same n and gradients as without (the backward
    differentiates r through x), four times the sums give half of n (eps ~0); opcheck with it; argument errors."""
    x = torch.randn(3, 19, 40, dtype=torch.bfloat16)
    g = torch.rand(40) + 0.5
    ss = x.double().pow(2).sum(-1).float()
    dn = torch.randn(3, 19, 40, dtype=torch.bfloat16)
    outs = []
    for s in (None, ss):
        xs, gs = x.clone().requires_grad_(), g.clone().requires_grad_()
        n = coda.ops.rmsnorm(xs, gs, 1e-30, sumsq=s)
        n.backward(dn)
        outs.append((n.detach(), xs.grad, gs.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
    half = coda.ops.rmsnorm(x, g, 1e-30, sumsq=4 * ss)
    torch.testing.assert_close(half.float(), outs[0][0].float() / 2, rtol=1e-2, atol=1e-3)
    torch.library.opcheck(torch.ops.coda.rmsnorm.default, (x[0], g, 1e-6, ss[0]))
    with pytest.raises(TypeError, match="sumsq"):
        coda.ops.rmsnorm(x, g, sumsq=ss.bfloat16())
    with pytest.raises(ValueError, match="sumsq"):
        coda.ops.rmsnorm(x, g, sumsq=ss[0])
