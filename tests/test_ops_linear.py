"""coda.ops.linear on the CPU (the documented reference path: same programs, torch math) vs torch autograd."""
import pytest
import torch

import coda
import coda.ops


@coda.epilogue
def scaled_silu(acc, s: coda.Scalar, r: coda.VecM, res: coda.TileMN, bias: coda.VecN):
    y = coda.silu(acc * s + bias) * r + res
    return {"out": y, "lse": coda.reduce_n(y, "logsumexp"), "mx": coda.reduce_n(y, "max"), "cs": coda.reduce_m(y)}


@pytest.mark.parametrize("save_preact", [False, True])
def test_linear_matches_autograd(save_preact):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(24, 32, dtype=torch.bfloat16, requires_grad=True)
    s = torch.tensor(0.8, requires_grad=True)
    r = torch.rand(2, 7, requires_grad=True)
    res = torch.randn(2, 7, 24, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    leaves = [x, w, s, r, res, bias]
    out = coda.ops.linear(x, w, epilogue=scaled_silu, save_preact=save_preact, s=s, r=r, res=res, bias=bias)
    assert out["out"].shape == (2, 7, 24) and out["lse"].shape == (2, 7) and out["cs"].shape == (24,)
    ups = {k: torch.randn(v.shape, dtype=torch.float32) for k, v in out.items()}
    ours = torch.autograd.grad(sum((out[k].float() * ups[k]).sum() for k in out), leaves)

    def torch_grads(dt):
        ls = [t.detach().to(dt).requires_grad_() for t in leaves]
        x_, w_, s_, r_, res_, b_ = ls
        acc = (x_ @ w_.T).to(torch.float64 if dt == torch.float64 else torch.float32)
        y = torch.nn.functional.silu(acc * s_ + b_) * r_.unsqueeze(-1) + res_
        ref = {"out": y, "lse": torch.logsumexp(y, -1), "mx": y.amax(-1), "cs": y.sum((0, 1))}
        return torch.autograd.grad(sum((ref[k].double() * ups[k]).sum() for k in ref), ls)

    want, theirs = torch_grads(torch.float64), torch_grads(torch.bfloat16)
    for name, a, b, t in zip("x w s r res bias".split(), ours, want, theirs):
        err = ((a.double() - b).norm() / b.norm()).item()
        err_torch = ((t.double() - b).norm() / b.norm()).item()
        assert err <= 2 * err_torch + 1e-3, (name, err, err_torch)


def test_linear_plain_and_errors():
    x = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    y = coda.ops.linear(x, w)
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    torch.testing.assert_close(x.grad.float(), torch.ones(5, 8) @ w.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="K=16 but weight has K=8"):
        coda.ops.linear(x, torch.randn(8, 8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="@coda.epilogue"):
        coda.ops.linear(x, w, epilogue=object())
    with pytest.raises(TypeError, match="missing operands"):
        coda.ops.linear(x, w, epilogue=scaled_silu, s=1.0)


def test_backward_gemm_kernel_path_and_unaligned_fallback(monkeypatch):
    """Aligned backward products go through gemm_for (the kernel on Hopper, the reference on CPU); shapes the
    kernel cannot align fall back to torch.matmul (documented in ops/_common.py)."""
    from coda.ops import _common
    calls = []
    real = _common.gemm_for
    monkeypatch.setattr(_common, "gemm_for", lambda *a, **k: calls.append(a) or real(*a, **k))
    dy, w = torch.randn(24, 16, dtype=torch.bfloat16), torch.randn(16, 40, dtype=torch.bfloat16)
    got = _common.backward_gemm(dy, w.t())  # K = 16: aligned
    torch.testing.assert_close(got.float(), (dy.float() @ w.float()), rtol=2e-2, atol=2e-2)
    assert len(calls) == 1
    dy, w = torch.randn(24, 14, dtype=torch.bfloat16), torch.randn(14, 40, dtype=torch.bfloat16)
    got = _common.backward_gemm(dy, w.t())  # K = 14: 28-byte rows, unaligned -> torch.matmul
    torch.testing.assert_close(got.float(), (dy @ w).float())
    assert len(calls) == 1


def test_backward_without_accumulator_dependence_skips_the_recompute(monkeypatch):
    """d(acc + res)/d acc = 1: the backward needs no recompute GEMM (dacc is the upstream gradient)."""
    import sys

    @coda.epilogue
    def add_res(acc, res: coda.TileMN):
        return acc + res

    mod = sys.modules["coda.ops.linear"]
    calls = []
    real = mod.gemm_for
    monkeypatch.setattr(mod, "gemm_for", lambda *a, **k: calls.append(a) or real(*a, **k))
    x = torch.randn(3, 20, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(3, 20, 48, requires_grad=True)
    y = coda.ops.linear(x, w, epilogue=add_res, res=r)
    assert len(calls) == 1  # the forward GEMM
    g = torch.randn(y.shape, dtype=torch.float64)
    got = torch.autograd.grad((y.double() * g).sum(), [x, w, r])
    assert len(calls) == 1  # no recompute GEMM in the backward
    x6, w6, r6 = (t.detach().double().requires_grad_() for t in (x, w, r))
    want = torch.autograd.grad(((x6 @ w6.T + r6) * g).sum(), [x6, w6, r6])
    for a, b in zip(got, want):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-2


@coda.epilogue
def glu_bias(acc, up_bias: coda.TileMN):
    g, u = coda.pairs(acc)
    return coda.silu(g) * (u + up_bias)


@coda.epilogue
def rotate_pairs(acc):
    a, b = coda.pairs(acc)
    return a - b, a + b


def _linear_op_args(epi, save_preact, tensors=(), scalars=(), N=24):
    x = torch.randn(12, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, 32, dtype=torch.bfloat16, requires_grad=True)
    return (x, w, epi.op_name, save_preact, ",".join(n for n, _ in tensors), [t for _, t in tensors],
            ",".join(n for n, _ in scalars), [v for _, v in scalars])


@pytest.mark.parametrize("case", ["identity", "scaled_silu", "scaled_silu_preact", "pairs_half_preact", "pairs_full"])
def test_linear_custom_op_passes_opcheck(case):
    """coda::linear and coda::linear_backward are torch.library custom ops whose fake implementations give the
    real results' shapes, dtypes and strides (opcheck: schema, fake tensors, autograd registration, AOT dispatch)."""
    torch.manual_seed(1)
    r = lambda *s: torch.randn(*s, requires_grad=True)  # noqa: E731
    args = {"identity": lambda: _linear_op_args(coda.ops.linear.__globals__["_identity"](), False),
            "scaled_silu": lambda: _linear_op_args(scaled_silu, False, [("r", r(12)), ("res", r(12, 24)),
                                                                         ("bias", r(24))], [("s", 0.7)]),
            "scaled_silu_preact": lambda: _linear_op_args(scaled_silu, True, [("s", r(1)), ("r", r(12)),
                                                                               ("res", r(12, 24)), ("bias", r(24))]),
            "pairs_half_preact": lambda: _linear_op_args(glu_bias, True, [("up_bias", r(12, 16))], N=32),
            "pairs_full": lambda: _linear_op_args(rotate_pairs, False)}[case]()
    torch.library.opcheck(torch.ops.coda.linear.default, args)
    outs = torch.ops.coda.linear(*args)
    n_keys = len(coda.dsl.by_op_name(args[2]).result_keys)
    grads = [torch.randn_like(o) if i % 2 == 0 else None for i, o in enumerate(outs[:n_keys])]
    epi = coda.dsl.by_op_name(args[2])
    saved = [outs[epi.result_keys.index(x.name)] for x in epi.reductions if x.op != "sum"] + list(outs[n_keys:])
    needs = [True, False] + [True] * len(args[5])
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    detached[5] = [t.detach() for t in args[5]]
    torch.library.opcheck(torch.ops.coda.linear_backward.default,
                          (grads, *detached, [s.detach() for s in saved], needs))


def test_linear_compiles_fullgraph_and_matches_eager():
    """torch.compile(fullgraph=True) traces coda.ops.linear as one custom op (no graph break into the kernels);
    outputs and gradients equal eager ones bitwise (CPU: the reference path; tests/test_dsl_gpu.py on the H100)."""
    torch.manual_seed(2)
    leaves = [torch.randn(2, 7, 32, dtype=torch.bfloat16), torch.randn(24, 32, dtype=torch.bfloat16),
              torch.tensor(0.8), torch.rand(2, 7), torch.randn(2, 7, 24), torch.randn(24)]

    def f(x, w, s, r, res, bias):
        out = coda.ops.linear(x, w, epilogue=scaled_silu, save_preact=True, s=s, r=r, res=res, bias=bias)
        return out["out"].float().square().sum() + out["lse"].sum() + out["cs"].sum() + out["mx"].sum()

    results = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        ls = [t.clone().requires_grad_() for t in leaves]
        loss = fn(*ls)
        results.append([loss.detach(), *torch.autograd.grad(loss, ls)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
