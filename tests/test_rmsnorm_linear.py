"""coda.ops.rmsnorm_linear on the CPU (the reference path: the same epilogue programs as torch ops): the rewrite
identities checked with sympy on the library epilogues' own traced expressions, fwd/bwd vs float64 autograd of the
unfused module (2x rule), torch.library.opcheck, torch.compile(fullgraph=True), error messages."""
import pytest
import sympy as sp
import torch

import coda.ops
from coda.dsl import ACC, operand_symbol
from coda.epilogues.rmsnorm import (rmsnorm_dgrad, rmsnorm_dgrad_finish, rmsnorm_dgrad_finish_residual,
                                    rmsnorm_dgrad_residual, rmsnorm_dgrad_split, rmsnorm_scale)
from rmsnorm_linear_ref import check_against_fp64, unfused

# ------------------------------------------------------------------------------------ the algebra (sympy)
M, K, N = 2, 3, 2  # small symbolic sizes: every identity is per element, the sums over m / k / n are exercised


def _symbols():
    h = sp.Matrix(M, K, lambda m, k: sp.Symbol(f"h{m}{k}", real=True))
    w = sp.Matrix(N, K, lambda n, k: sp.Symbol(f"w{n}{k}", real=True))
    g = [sp.Symbol(f"g{k}", real=True) for k in range(K)]
    dy = sp.Matrix(M, N, lambda m, n: sp.Symbol(f"dy{m}{n}", real=True))
    eps = sp.Symbol("eps", positive=True)
    r = [1 / sp.sqrt(sum(h[m, k] ** 2 for k in range(K)) / K + eps) for m in range(M)]
    y = sp.Matrix(M, K, lambda m, k: h[m, k] * r[m] * g[k]) * w.T  # RMSNorm(h) @ W^T, unfused
    loss = sum(dy[m, n] * y[m, n] for m in range(M) for n in range(N))  # <dy, y>: its gradients are the VJPs
    return h, w, g, dy, r, y, loss


def _apply(expr, acc, **ops):
    """One element of a library epilogue: its traced expression with acc and the operands substituted."""
    return expr.subs({ACC: acc, **{operand_symbol(k): v for k, v in ops.items()}})


def _zero(e):
    return sp.simplify(e) == 0


def test_forward_identity():
    h, w, g, dy, r, y, _ = _symbols()
    acc = h * (w * sp.diag(*g)).T  # the GEMM on the folded weight W' = W diag(gamma)
    for m in range(M):
        for n in range(N):
            assert _zero(y[m, n] - _apply(rmsnorm_scale.exprs["out"], acc[m, n], r=r[m]))


def test_backward_identities():
    h, w, g, dy, r, y, loss = _symbols()
    dn = dy * w  # the dX GEMM's accumulator (unfolded W)
    c = [sum(dy[m, n] * y[m, n] for n in range(N)) / K for m in range(M)]
    # the key step: sum_k (dy W')_k xhat_k == sum_n dy_n y_n
    dxhat = dy * (w * sp.diag(*g))
    for m in range(M):
        assert _zero(sum(dxhat[m, k] * h[m, k] * r[m] for k in range(K)) - K * c[m])
    ops = lambda m, k: dict(gamma=g[k], h=h[m, k], r=r[m], c=c[m])  # noqa: E731
    normed = sp.Matrix(M, K, lambda m, k: _apply(rmsnorm_dgrad.exprs["normed"], dn[m, k], **ops(m, k)))
    dres = sp.Symbol("dres", real=True)
    for m in range(M):
        for k in range(K):
            dh = sp.diff(loss, h[m, k])
            assert _zero(dh - _apply(rmsnorm_dgrad.exprs["out"], dn[m, k], **ops(m, k)))
            got = _apply(rmsnorm_dgrad_residual.exprs["out"], dn[m, k], **ops(m, k), dres=dres)
            assert _zero(dh + dres - got)
    for k in range(K):  # dgamma: the column reduction of the dX epilogue, summed over the rows
        got = sum(_apply(rmsnorm_dgrad.red_specs["dgamma"][2], dn[m, k], **ops(m, k)) for m in range(M))
        assert _zero(sp.diff(loss, g[k]) - got)
    dw = dy.T * normed  # the dW GEMM on the epilogue's extra output
    for n in range(N):
        for k in range(K):
            assert _zero(sp.diff(loss, w[n, k]) - dw[n, k])


def test_split_backward_identities():
    """The wide-linear backward (ops.rmsnorm_linear.split_backward): c = (r / K) sum_k h (acc gamma)_k from the dX
    GEMM's own tile equals (1/K) sum_n dy y, and the split pair of epilogues gives the same dh, normed, dgamma."""
    h, w, g, dy, r, y, loss = _symbols()
    dn = dy * w
    dres = sp.Symbol("dres", real=True)
    for m in range(M):
        t = [_apply(rmsnorm_dgrad_split.exprs["out"], dn[m, k], gamma=g[k], h=h[m, k]) for k in range(K)]
        s = sum(_apply(rmsnorm_dgrad_split.red_specs["s"][2], dn[m, k], gamma=g[k], h=h[m, k]) for k in range(K))
        c = r[m] * s / K
        assert _zero(c - sum(dy[m, n] * y[m, n] for n in range(N)) / K)
        for k in range(K):
            fin = dict(t=t[k], h=h[m, k], r=r[m], c=c, gamma=g[k])
            dh = sp.diff(loss, h[m, k])
            assert _zero(dh - _apply(rmsnorm_dgrad_finish.exprs["out"], 0, **fin))
            assert _zero(dh + dres - _apply(rmsnorm_dgrad_finish_residual.exprs["out"], 0, **fin, dres=dres))
            assert _zero(_apply(rmsnorm_dgrad_finish.exprs["normed"], 0, **fin) - h[m, k] * r[m] * g[k])
    for k in range(K):  # dgamma: the finishing pass's column reduction, summed over the rows
        got = sum(_apply(rmsnorm_dgrad_finish.red_specs["dgamma"][2], 0, t=dn[m, k], h=h[m, k], r=r[m], c=0,
                         gamma=g[k]) for m in range(M))
        assert _zero(sp.diff(loss, g[k]) - got)


@pytest.mark.parametrize("K,N,split", [(16, 72, True), (40, 24, False), (32, 80, False), (32, 88, True)])
def test_split_backward_launches(monkeypatch, K, N, split):
    """N > 2.5 K: the backward runs the dX GEMM with rmsnorm_dgrad_split and one K = 0 rmsnorm_dgrad_finish pass
    (no row_dot pass over dy and y, and y is not saved); otherwise row_dot then rmsnorm_dgrad. Both match float64
    autograd (test_matches_fp64_autograd covers both branches with residuals and batch dims)."""
    x, g, w = _inputs(24, K, N, residual=False, grad=True)
    y = coda.ops.rmsnorm_linear(x, g, w, 1e-5)
    saved = y.grad_fn.next_functions[0][0].saved_tensors  # the custom op's node (y.grad_fn: the reshape)
    assert (saved[-1] is None) == split  # the output y is saved only for the row_dot pass
    log, real = [], coda.reference.gemm
    monkeypatch.setattr(coda.reference, "gemm", lambda a, b, *, epilogue=None, **kw: log.append(
        getattr(epilogue, "name", None)) or real(a, b, epilogue=epilogue, **kw))
    y.backward(torch.randn_like(y))
    want = ["rmsnorm_dgrad_split", "rmsnorm_dgrad_finish", None] if split else ["row_dot", "rmsnorm_dgrad", None]
    assert log == want, log


def test_folded_weight_alternative():
    """The formulation on W' (epilogues/rmsnorm.py docstring): dW = (dy^T xhat) diag(gamma),
    dgamma_k = sum_n W_nk (dy^T xhat)_nk."""
    h, w, g, dy, r, y, loss = _symbols()
    G = dy.T * sp.Matrix(M, K, lambda m, k: h[m, k] * r[m])
    for k in range(K):
        assert _zero(sp.diff(loss, g[k]) - sum(w[n, k] * G[n, k] for n in range(N)))
        for n in range(N):
            assert _zero(sp.diff(loss, w[n, k]) - G[n, k] * g[k])


# ------------------------------------------------------------------------------ numerics vs float64 autograd
@pytest.mark.parametrize("lead,K,N", [((37,), 40, 24), ((3, 13), 48, 40), ((2, 4, 5), 64, 16), ((40,), 16, 72)])
@pytest.mark.parametrize("residual", [False, True])
def test_matches_fp64_autograd(lead, K, N, residual):
    check_against_fp64(lead, K, N, residual=residual)


def test_fp16_and_bf16_gamma():
    check_against_fp64((3, 13), 48, 40, residual=True, dtype=torch.float16, gamma_dtype=torch.bfloat16)


def _inputs(M_=24, K_=32, N_=16, residual=True, grad=True):
    torch.manual_seed(0)
    t = [torch.randn(M_, K_, dtype=torch.bfloat16), torch.rand(K_) + 0.5,
         torch.randn(N_, K_, dtype=torch.bfloat16) / K_ ** 0.5]
    if residual:
        t.append(torch.randn(M_, K_, dtype=torch.bfloat16))
    return [v.requires_grad_(grad) for v in t]


def test_partial_gradients():
    """Frozen weight (no dW GEMM), and a gradient that arrives only on the residual stream h."""
    x, g, w, res = _inputs()
    w.requires_grad_(False)
    y, h = coda.ops.rmsnorm_linear(x, g, w, residual=res)
    dx, dg = torch.autograd.grad(y.float().sum(), (x, g))
    x64, g64, w64, r64 = (v.detach().double().requires_grad_() for v in (x, g, w, res))
    y64, _ = unfused(x64, r64, g64, w64, 1e-6)
    want = torch.autograd.grad(y64.sum(), (x64, g64))
    for a, b in zip((dx, dg), want):
        torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2)
    y, h = coda.ops.rmsnorm_linear(x, g, w, residual=res)
    up = torch.randn_like(h)
    dx, dres, dg = torch.autograd.grad(h, (x, res, g), up, allow_unused=True)
    assert torch.equal(dx, up) and torch.equal(dres, up) and (dg is None or not dg.any())


def test_empty_rows():
    x, g, w = _inputs(M_=0, residual=False)
    y = coda.ops.rmsnorm_linear(x, g, w)
    assert y.shape == (0, 16)
    dx, dg, dw = torch.autograd.grad(y.sum(), (x, g, w))
    assert dx.shape == (0, 32) and not dg.any() and not dw.any()


# ---------------------------------------------------------------------------------- torch integration
@pytest.mark.parametrize("residual", [False, True])
def test_opcheck(residual):
    x, g, w, *res = _inputs(M_=16, residual=residual)
    args = (x, g, w, res[0] if res else None, 1e-5)
    torch.library.opcheck(torch.ops.coda.rmsnorm_linear.default, args)
    y, h, r = torch.ops.coda.rmsnorm_linear(*args)
    for saved_y in (y, None):  # None: the split backward of wide linears (N > 2.5 K)
        bargs = (torch.randn_like(y), torch.randn_like(h) if residual else None, h if residual else x, g, w, r,
                 saved_y, True)
        torch.library.opcheck(torch.ops.coda.rmsnorm_linear_backward.default, tuple(
            a.detach() if isinstance(a, torch.Tensor) else a for a in bargs))


def test_torch_compile_fullgraph():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()

    def block(x, g, w, res):
        y, h = coda.ops.rmsnorm_linear(x, g, w, residual=res)
        return (y.float() ** 2).sum() + h.float().sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    for m in (24, 40):
        x, g, w, res = _inputs(M_=m)
        loss = compiled(x, g, w, res)
        grads = torch.autograd.grad(loss, (x, g, w, res))
        loss_eager = block(x, g, w, res)
        want = torch.autograd.grad(loss_eager, (x, g, w, res))
        torch.testing.assert_close(loss, loss_eager)
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b)
    assert "torch.ops.coda.rmsnorm_linear" in counter.graphs[0].code  # one opaque node, not decomposed


# ----------------------------------------------------------------------------------------------- errors
def _bad(**change):
    x, g, w, res = _inputs(grad=False)
    kw = dict(x=x, norm_weight=g, weight=w, eps=1e-6, residual=res)
    kw.update(change)
    return kw


@pytest.mark.parametrize("change,exc,match", [
    (dict(x=[1.0]), TypeError, "x must be a torch.Tensor"),
    (dict(weight=torch.randn(16, 24, dtype=torch.bfloat16)), ValueError, r"weight must be \(N, K\) with K=32"),
    (dict(norm_weight=torch.ones(16)), ValueError, r"norm_weight must have shape \(32,\)"),
    (dict(residual=torch.randn(23, 32, dtype=torch.bfloat16)), ValueError, "residual must have x's shape"),
    (dict(x=torch.randn(24, 32)), TypeError, "x must be bfloat16 or float16"),
    (dict(weight=torch.randn(16, 32, dtype=torch.float16)), TypeError, "weight must have x's dtype"),
    (dict(residual=torch.randn(24, 32, dtype=torch.float16)), TypeError, "residual must have x's dtype"),
    (dict(norm_weight=torch.ones(32, dtype=torch.float64)), TypeError, "norm_weight must be float32"),
    (dict(norm_weight=torch.ones(32, device="meta")), ValueError, "norm_weight is on meta but x is on cpu"),
    (dict(eps=0.0), ValueError, "eps must be a finite number > 0"),
    (dict(eps=float("nan")), ValueError, "eps must be a finite number > 0"),
    (dict(eps="1e-6"), TypeError, "eps must be a Python number"),
    (dict(weight=torch.randn(12, 32, dtype=torch.bfloat16)), ValueError, "weight: N = weight.shape.* = 12 must be a "
                                                                         "multiple of 8"),
    (dict(x=torch.randn(24, 12, dtype=torch.bfloat16), norm_weight=torch.ones(12), residual=None,
          weight=torch.randn(16, 12, dtype=torch.bfloat16)), ValueError, "x: K = x.shape.* = 12 must be a multiple"),
    (dict(x=torch.randn(32, 24, dtype=torch.bfloat16).t()), ValueError, "x: the last dim must be contiguous"),
])
def test_errors(change, exc, match):
    with pytest.raises(exc, match=match):
        coda.ops.rmsnorm_linear(**_bad(**change))


def test_rejects_non_hopper_gpu_before_compute(monkeypatch):
    """The device rule of ops/_common.gemm_for holds for this op too: checked before anything runs."""
    import importlib
    mod = importlib.import_module("coda.ops.rmsnorm_linear")  # the module (coda.ops.rmsnorm_linear is the op)
    calls = []
    monkeypatch.setattr(mod, "normed_operands", lambda *a: calls.append(a))
    monkeypatch.setattr(mod, "gemm_for", lambda device, entry: (_ for _ in ()).throw(RuntimeError(f"{entry} needs")))
    x, g, w = _inputs(residual=False, grad=False)
    with pytest.raises(RuntimeError, match="coda.ops.rmsnorm_linear needs"):
        coda.ops.rmsnorm_linear(x, g, w)
    assert not calls


@pytest.mark.parametrize("name", ["rmsnorm_dgrad_split", "rmsnorm_dgrad_finish", "rmsnorm_dgrad_finish_residual"])
def test_split_backward_epilogues_compile_for_sm90(name):
    """The split backward's kernels (the dX GEMM's fp32 output with a row reduction; the K = 0 pass with an fp32
    TileMN operand, an extra output and a column reduction) compile for sm_90a with WGMMA and no spills."""
    pytest.importorskip("cutlass")
    import coda.epilogues.rmsnorm as lib
    from coda.check import compile_variant
    from coda.config import default_config
    out = "fp32" if name == "rmsnorm_dgrad_split" else "bf16"
    row = compile_variant(default_config(8192, 4096, 8), getattr(lib, name), out_dtype=out)
    assert row["ok"] and row["wgmma"] > 0 and row["spill_bytes"] == 0, row


def test_row_dot_compiles_for_sm90():
    """The backward's c = sum_n dy y launch (``row_dot``: two TileMN operands, a per-row reduction, no main
    output, accumulator unused) compiles for sm_90a with WGMMA and no spills; its reference is the row dot."""
    pytest.importorskip("cutlass")
    from coda.check import compile_variant
    from coda.config import default_config
    from coda.epilogues.rmsnorm import row_dot
    row = compile_variant(default_config(8192, 28672, 8), row_dot)
    assert row["ok"] and row["wgmma"] > 0 and row["spill_bytes"] == 0, row
    g = torch.Generator().manual_seed(3)
    dy, y = torch.randn(37, 200, generator=g).bfloat16(), torch.randn(37, 200, generator=g).bfloat16()
    got = coda.reference.gemm(dy[:, :0], torch.empty(200, 0, dtype=torch.bfloat16), epilogue=row_dot, dy=dy, y=y)["dot"]
    torch.testing.assert_close(got, (dy.double() * y.double()).sum(-1).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M,N,first", [(16, 72, "scale_sumsq"), (72, 16, "fold_gamma"), (72, 72, "scale_sumsq")])
def test_gamma_goes_to_the_cheaper_operand(monkeypatch, M, N, first):
    """M <= N: one K = 0 pass writes x * gamma (M x K) and the sums of squares; M > N: gamma folds into the weight
    (N x K). Either way one more GEMM (rmsnorm_scale) and the result matches float64 autograd."""
    log, real = [], coda.reference.gemm
    monkeypatch.setattr(coda.reference, "gemm", lambda a, b, *, epilogue=None, **kw: log.append(
        (getattr(epilogue, "name", None), tuple(a.shape), tuple(b.shape))) or real(a, b, epilogue=epilogue, **kw))
    K = 40
    x, g, w = _inputs(M, K, N, residual=False, grad=False)
    y = coda.ops.rmsnorm_linear(x, g, w, 1e-5)
    rows = M if first == "scale_sumsq" else N
    assert log == [(first, (rows, 0), (K, 0)), ("rmsnorm_scale", (M, K), (N, K))], log
    ref = unfused(x.double(), None, g.double(), w.double(), 1e-5)[0]
    assert (y.double() - ref).abs().max() < 0.05 * ref.abs().max()


def test_scale_sumsq_compiles_for_sm90():
    """The forward's activation-side pre-pass (TileMN h, VecN gamma, an output and a per-row reduction; accumulator
    unused) compiles for sm_90a with no spills; its reference gives h * gamma and sum h^2."""
    from coda.epilogues.rmsnorm import scale_sumsq
    gen = torch.Generator().manual_seed(4)
    h, g = torch.randn(37, 200, generator=gen).bfloat16(), torch.rand(200, generator=gen) + 0.5
    got = coda.reference.gemm(h[:, :0], torch.empty(200, 0, dtype=torch.bfloat16), epilogue=scale_sumsq,
                              out_dtype=torch.bfloat16, h=h, gamma=g)
    torch.testing.assert_close(got["out"], (h.float() * g).bfloat16())
    torch.testing.assert_close(got["ss"], h.double().square().sum(-1).float(), rtol=1e-5, atol=1e-5)
    pytest.importorskip("cutlass")
    from coda.check import compile_variant
    from coda.config import default_config
    row = compile_variant(default_config(8192, 4096, 8), scale_sumsq)
    assert row["ok"] and row["spill_bytes"] == 0, row
