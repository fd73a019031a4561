"""coda.ops.mlp / coda.ops.rmsnorm_swiglu on the CPU (the reference path: the same epilogue programs as torch ops):
forward and every gradient vs float64 autograd of the unfused formula (2x rule against plain torch in the input
dtype), what the backward saves and launches, torch.library.opcheck, torch.compile(fullgraph=True), errors, and the
sm_90a compile of the backward's epilogues. ``check_against_fp64`` is shared with tests/test_mlp_gpu.py."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import coda.ops
import coda.reference

mlp_mod = importlib.import_module("coda.ops.mlp")  # coda.ops.mlp is the function


# ------------------------------------------------------------------------------------------------ vs float64
def unfused(x, gamma, w_gate_up, w_down, eps, residual=True):
    """``x + down(silu(gate(n)) * up(n))``, n = RMSNorm(x) * gamma (``w_down`` None: ``silu(gate(n)) * up(n)``;
    ``residual=False``: no ``x +``), in the leaves' dtype. Below float64 it is what a plain torch model does:
    statistics in fp32, n rounded to x's dtype."""
    w_gate, w_up = w_gate_up[0::2], w_gate_up[1::2]
    if x.dtype == torch.float64:
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    else:
        xf = x.float()
        n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * gamma.to(x.dtype)
    a = F.silu(F.linear(n, w_gate)) * F.linear(n, w_up)
    return a if w_down is None else (x if residual else 0) + F.linear(a, w_down)


def rel(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_against_fp64(lead, H, I, *, down=True, device="cpu", dtype=torch.bfloat16, gamma_dtype=torch.float32,
                       eps=1e-6, floor=1e-4, seed=0, poison=None, save_preact=True, residual=True):
    """Forward and the gradients of x, norm_weight, w_gate_up (and w_down) of ``coda.ops.mlp`` (``down=False``:
    ``coda.ops.rmsnorm_swiglu``) vs float64 autograd of :func:`unfused`: error(ours) <= 2 * error(plain torch in
    ``dtype``) + floor, each against float64; ``save_preact`` as the ops take it. ``poison``: called before our
    forward and our backward (the GPU test fills the allocator's cached blocks with NaN there, so that an unwritten
    output element shows)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    x, wgu = rnd(*lead, H), rnd(2 * I, H, scale=H ** -0.5)
    gamma = (1 + 0.5 * torch.randn(H, generator=g)).to(device=device, dtype=gamma_dtype)
    wd = rnd(H, I, scale=I ** -0.5) if down else None
    dy = rnd(*lead, H if down else I)
    names = ["x", "norm_weight", "w_gate_up", "w_down"][:4 if down else 3]

    def run(fn, fp64=False):
        leaves = [t.detach().to(torch.float64 if fp64 else t.dtype).requires_grad_()
                  for t in (x, gamma, wgu, wd) if t is not None]
        if poison is not None and fn is not unfused:
            poison()
        y = fn(*leaves[:3], leaves[3] if down else None, eps, residual)
        if poison is not None and fn is not unfused:
            poison()
        grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
        return dict(zip(["y"] + ["d" + n for n in names], [y, *grads]))

    def ours(x_, gamma_, wgu_, wd_, eps_, residual_):
        if down:
            return coda.ops.mlp(x_, gamma_, wgu_, wd_, eps_, save_preact=save_preact, residual=residual_)
        return coda.ops.rmsnorm_swiglu(x_, gamma_, wgu_, eps_, save_preact=save_preact)

    got, want, theirs = run(ours), run(unfused, fp64=True), run(unfused)
    assert got["y"].shape == (*lead, H if down else I) and got["y"].dtype == dtype
    report = {}
    for k, ref in want.items():
        assert got[k].shape == ref.shape and got[k].dtype == theirs[k].dtype, k
        assert torch.isfinite(got[k]).all(), f"{k}: non-finite elements (unwritten output?)"
        e_ours, e_torch = rel(got[k], ref), rel(theirs[k], ref)
        report[k] = (e_ours, e_torch)
        assert e_ours <= 2 * e_torch + floor, (k, e_ours, e_torch)
    return report


@pytest.mark.parametrize("lead,H,I", [((37,), 64, 48), ((2, 13), 64, 48), ((3, 127), 200, 136)])
@pytest.mark.parametrize("save_preact", [True, False])
def test_mlp_matches_float64(lead, H, I, save_preact):
    check_against_fp64(lead, H, I, save_preact=save_preact)


@pytest.mark.parametrize("lead", [(37,), (3, 127)])
def test_mlp_without_residual_matches_float64(lead):
    """``residual=False`` (``down(...)`` only: SwiGLUMLP inside a decoder layer that adds x itself)."""
    check_against_fp64(lead, 200, 136, residual=False)


@pytest.mark.parametrize("dtype,gamma_dtype", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_mlp_dtypes(dtype, gamma_dtype):
    check_against_fp64((2, 13), 64, 48, dtype=dtype, gamma_dtype=gamma_dtype)


@pytest.mark.parametrize("lead", [(37,), (3, 127)])
@pytest.mark.parametrize("save_preact", [True, False])
def test_rmsnorm_swiglu_matches_float64(lead, save_preact):
    check_against_fp64(lead, 200, 136, down=False, save_preact=save_preact)


def _inputs(M=24, H=64, I=48, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(M, H, generator=g).bfloat16(), 1 + 0.1 * torch.randn(H, generator=g),
         (torch.randn(2 * I, H, generator=g) * H ** -0.5).bfloat16(),
         (torch.randn(H, I, generator=g) * I ** -0.5).bfloat16()]
    return [x.requires_grad_(grad) for x in t]


@pytest.mark.parametrize("need", [(True, False, False, False), (False, True, False, False),
                                  (False, False, True, False), (False, False, False, True),
                                  (False, True, True, True)])
@pytest.mark.parametrize("save_preact,residual", [(True, True), (False, True), (True, False)])
def test_partial_gradients(need, save_preact, residual):
    """Only the gradients asked for are formed; they equal those of the full backward (with and without the
    residual: the backward op's needs and residual arguments in their places)."""
    leaves = _inputs()
    kw = dict(save_preact=save_preact, residual=residual)
    full = torch.autograd.grad(coda.ops.mlp(*leaves, **kw).float().square().sum(), leaves)
    for t, n in zip(leaves, need):
        t.requires_grad_(n)
    wanted = [t for t in leaves if t.requires_grad]
    got = torch.autograd.grad(coda.ops.mlp(*leaves, **kw).float().square().sum(), wanted)
    want = [f for f, n in zip(full, need) if n]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)


def test_empty_rows():
    x, gamma, wgu, wd = _inputs(M=0)
    y = coda.ops.mlp(x.reshape(2, 0, 64), gamma, wgu, wd)
    assert y.shape == (2, 0, 64)
    grads = torch.autograd.grad(y.sum(), (x, gamma, wgu, wd), allow_unused=True)
    assert [g.abs().sum().item() for g in grads[1:]] == [0.0, 0.0, 0.0] and grads[0].shape == (0, 64)


# ------------------------------------------------------------------------------------------------ saved / launched
@pytest.mark.parametrize("save_preact", [True, False])
def test_backward_saves_only_what_it_needs(save_preact):
    """Saved: x, norm_weight, w_gate_up, w_down, a (M x I), r (M) and with save_preact g, u (M x I each); never W'
    (2I x H) nor the normalised activation."""
    M, H, I = 24, 64, 48
    x, gamma, wgu, wd = _inputs(M, H, I)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = coda.ops.mlp(x, gamma, wgu, wd, save_preact=save_preact)
    shapes = sorted(tuple(t.shape) for t in saved if t.numel())
    want = [(M, H), (H,), (2 * I, H), (H, I), (M, I), (M,)] + [(M, I), (M, I)] * save_preact
    assert shapes == sorted(want), shapes
    assert sum(t.data_ptr() == p.data_ptr() for t in saved for p in (x, gamma, wgu, wd)) == 4  # the inputs as given
    y.float().sum().backward()


@pytest.mark.parametrize("save_preact,residual", [(True, True), (False, True), (True, False)])
def test_backward_launches(monkeypatch, save_preact, residual):
    """Forward: x * gamma and r's sum of squares (a K = 0 launch; M <= 2I), 2 GEMMs (rms_swiglu, with save_preact
    its _preact variant; residual_add, or the plain down GEMM with residual=False). Backward with save_preact: the
    GEMM dy W_down whose 1 -> 2 epilogue writes dacc and d_r from the saved g, u (da never written), dW_down =
    dy^T a; without: da = dy W_down, dW_down, then x * gamma again and the recompute GEMM (rms_swiglu's backward).
    Then the dX GEMM with the gamma + radial (+ residual) epilogue on the unfolded weight, dW' = dacc^T x with the
    fold_grads epilogue: no other launch."""
    log = []
    real = coda.reference.gemm

    def gemm(a, b, *, epilogue=None, **kw):
        log.append((getattr(epilogue, "name", None), tuple(a.shape), tuple(b.shape)))
        return real(a, b, epilogue=epilogue, **kw)

    monkeypatch.setattr(coda.reference, "gemm", gemm)
    M, H, I = 24, 64, 48
    leaves = _inputs(M, H, I)
    y = coda.ops.mlp(*leaves, save_preact=save_preact, residual=residual)
    fwd = "rms_swiglu_preact" if save_preact else "rms_swiglu"
    scale = ("scale_sumsq", (M, 0), (H, 0))  # M <= 2I: x * gamma and sum x^2, a K = 0 launch
    assert log == [scale, (fwd, (M, H), (2 * I, H)), ("residual_add" if residual else None, (M, I), (H, I))]
    log.clear()
    torch.autograd.grad(y.float().sum(), leaves)
    dy_wd, dw_down = (M, H), (I, H)
    head = ([("rms_swiglu_bwd_on_preact_on_acc", dy_wd, dw_down), (None, (H, M), (I, M))] if save_preact
            else [(None, dy_wd, dw_down), (None, (H, M), (I, M)), scale, ("rms_swiglu_bwd", (M, H), (2 * I, H))])
    radial = "rms_radial_residual" if residual else "rms_radial"
    assert log == [*head, (radial, (M, 2 * I), (H, 2 * I)), ("fold_grads", (2 * I, M), (H, M))], log


def test_no_preact_without_autograd(monkeypatch):
    """save_preact only when autograd records the call: under no_grad, or with no input requiring grad, the forward
    is the plain rms_swiglu GEMM (no M x 2I pre-activation written)."""
    log, real = [], coda.reference.gemm
    monkeypatch.setattr(coda.reference, "gemm",
                        lambda a, b, *, epilogue=None, **kw: log.append(getattr(epilogue, "name", None))
                        or real(a, b, epilogue=epilogue, **kw))
    leaves = _inputs()
    with torch.no_grad():
        coda.ops.mlp(*leaves)
        coda.ops.rmsnorm_swiglu(*leaves[:3])
    coda.ops.mlp(*_inputs(grad=False))
    mlp = ["scale_sumsq", "rms_swiglu", "residual_add"]
    assert log == mlp + mlp[:2] + mlp, log
    log.clear()
    coda.ops.mlp(*leaves)
    assert log[1] == "rms_swiglu_preact"


# ------------------------------------------------------------------------------------------------ torch integration
@pytest.mark.parametrize("save_preact,residual,sumsq", [(True, True, False), (False, True, False),
                                                         (True, False, False), (True, True, True)])
def test_opcheck(save_preact, residual, sumsq):
    x, gamma, wgu, wd = (t.detach() for t in _inputs(M=16))
    torch.library.opcheck(torch.ops.coda.mlp.default, (x, gamma, wgu, wd, 1e-5, save_preact, residual, sumsq))
    torch.library.opcheck(torch.ops.coda.rmsnorm_swiglu.default, (x, gamma.bfloat16(), wgu, 1e-5, save_preact))
    y, a, r, g, u, ss = torch.ops.coda.mlp(x, gamma, wgu, wd, 1e-5, save_preact, residual, sumsq)
    assert ss.shape == ((16,) if sumsq else (0,))
    assert g.shape == u.shape == ((16, 48) if save_preact else (0,))
    g, u = (g, u) if save_preact else (None, None)
    dy, da = torch.randn_like(y), torch.randn_like(a)
    for need in ((True, True, True, True), (True, False, False, False), (False, True, True, False),
                 (False, False, False, True)):
        torch.library.opcheck(torch.ops.coda.mlp_backward.default, (dy, x, gamma, wgu, wd, a, r, g, u, *need,
                                                                    residual))
        torch.library.opcheck(torch.ops.coda.mlp_backward.default, (da, x, gamma, wgu, None, None, r, g, u,
                                                                    *need[:3], False, False))


def test_torch_compile_fullgraph():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()

    def block(x, gamma, wgu, wd):
        return coda.ops.mlp(x, gamma, wgu, wd).float().square().sum() + \
            coda.ops.rmsnorm_swiglu(x, gamma, wgu).float().sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    for m in (24, 40):
        leaves = _inputs(M=m, seed=m)
        loss = compiled(*leaves)
        grads = torch.autograd.grad(loss, leaves)
        loss_eager = block(*leaves)
        want = torch.autograd.grad(loss_eager, leaves)
        torch.testing.assert_close(loss, loss_eager)
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b)
    code = counter.graphs[0].code
    assert "torch.ops.coda.mlp" in code and "torch.ops.coda.rmsnorm_swiglu" in code  # opaque nodes


# ------------------------------------------------------------------------------------------------ errors
def _bf(*shape):
    return torch.randn(*shape).bfloat16()


@pytest.mark.parametrize("args,exc,match", [
    (dict(x=[1.0]), TypeError, "x must be a torch.Tensor"),
    (dict(norm_weight=None), TypeError, "norm_weight must be a torch.Tensor"),
    (dict(w_gate_up="w"), TypeError, "w_gate_up must be a torch.Tensor"),
    (dict(w_down=None), TypeError, "w_down must be a torch.Tensor"),
    (dict(eps="1e-6"), TypeError, "eps must be a Python number"),
    (dict(eps=0.0), ValueError, "eps must be a finite number > 0"),
    (dict(x=torch.randn(4, 64)), TypeError, "x must be bfloat16 or float16"),
    (dict(w_gate_up=_bf(96, 64).half()), TypeError, "w_gate_up must have x's dtype"),
    (dict(w_gate_up=_bf(96, 32)), ValueError, r"w_gate_up must be \(2I, H\) with H=64"),
    (dict(w_gate_up=_bf(95, 64)), ValueError, "w_gate_up has 95 rows"),
    (dict(w_gate_up=_bf(40, 64), w_down=_bf(64, 20)), ValueError, r"w_gate_up has 40 rows.*I % 8 == 0"),
    (dict(w_gate_up=_bf(96, 64).to("meta")), ValueError, "w_gate_up is on meta"),
    (dict(x=_bf(4, 12), norm_weight=torch.ones(12), w_gate_up=_bf(96, 12), w_down=_bf(12, 48)), ValueError,
     r"x: H = x.shape\[-1\] = 12 must be a multiple of 8"),
    (dict(x=_bf(64, 4).t()), ValueError, "x: the last dim must be contiguous"),
    (dict(norm_weight=torch.ones(63)), ValueError, r"norm_weight must have shape \(64,\)"),
    (dict(norm_weight=torch.ones(64, dtype=torch.float64)), TypeError, "norm_weight must be float32, bfloat16"),
    (dict(norm_weight=torch.ones(64, device="meta")), ValueError, "norm_weight is on meta"),
    (dict(w_down=_bf(64, 40)), ValueError, r"w_down must be \(H, I\) = \(64, 48\)"),
    (dict(w_down=_bf(48, 64).t()), ValueError, "w_down: the last dim must be contiguous"),
    (dict(w_down=_bf(64, 48).half()), TypeError, "w_down must have x's dtype"),
    (dict(w_down=_bf(64, 48).to("meta")), ValueError, "w_down is on meta"),
])
def test_mlp_errors_before_compute(monkeypatch, args, exc, match):
    calls = []
    monkeypatch.setattr(mlp_mod, "gemm_for", lambda *a: calls.append(a))
    kw = dict(x=_bf(4, 64), norm_weight=torch.ones(64), w_gate_up=_bf(96, 64), w_down=_bf(64, 48), eps=1e-6)
    kw.update(args)
    with pytest.raises(exc, match=match) as e:
        coda.ops.mlp(**kw)
    assert str(e.value).startswith("mlp: ") and not calls


def test_rmsnorm_swiglu_errors_name_weight_gu():
    with pytest.raises(ValueError, match="rmsnorm_swiglu: weight_gu has 95 rows"):
        coda.ops.rmsnorm_swiglu(_bf(4, 64), torch.ones(64), _bf(95, 64))
    with pytest.raises(TypeError, match="rmsnorm_swiglu: norm_weight must be a torch.Tensor"):
        coda.ops.rmsnorm_swiglu(_bf(4, 64), None, _bf(96, 64))


# ------------------------------------------------------------------------------------------------ sm_90a compile
def test_backward_epilogues_compile_for_sm90():
    """The launches the backward adds compile for sm_90a with WGMMA (coda.check, CPU): rms_swiglu's sympy backward
    with the VecM gradient of r (on the recompute GEMM, and on the saved pre-activation as a K = 0 launch: its
    operands are TileMN), the dX GEMM's gamma + radial (+ residual) epilogue on the MN-major weight view, and the dW'
    GEMM's fold_grads epilogue on MN-major operands. The forward with the saved pre-activation too."""
    pytest.importorskip("cutlass")
    from coda.autodiff import with_preact
    from coda.check import compile_variant
    from coda.config import default_config
    from coda.ops.linear import backward_of
    cfg = default_config(8192, 8192, 8192)
    for epi, majors in ((backward_of(mlp_mod.rms_swiglu, ("out",), ("r",)), ("k", "k")),
                        (backward_of(mlp_mod.rms_swiglu, ("out",), ("r",), preact=True), ("k", "k")),
                        (with_preact(mlp_mod.rms_swiglu), ("k", "k")),
                        (mlp_mod.rms_radial_residual, ("k", "mn")), (mlp_mod.rms_radial, ("k", "mn")),
                        (mlp_mod.fold_grads, ("mn", "mn"))):
        row = compile_variant(cfg, epi, majors=majors)
        assert row["wgmma"] > 0 and (row["ok"] or "spill" in row["error"]), (epi.name, row["error"])


def test_return_sumsq():
    """return_sumsq=True: the rows' sums of squares of y as stored (from the down projection's epilogue), y and
    every gradient bitwise those of the plain call (no gradient flows through ss); argument errors."""
    leaves = _inputs(M=40)
    y, ss = coda.ops.mlp(*leaves, return_sumsq=True)
    ref = y.detach().double().pow(2).sum(-1)
    assert ss.dtype == torch.float32 and ss.shape == (40,) and not ss.requires_grad
    assert ((ss.double() - ref).abs().max() / ref.max()).item() < 1e-6
    dy = torch.randn_like(y)
    y.backward(dy)
    grads = [t.grad.clone() for t in leaves]
    plain = _inputs(M=40)
    y2 = coda.ops.mlp(*plain)
    y2.backward(dy)
    assert torch.equal(y, y2) and all(torch.equal(a, b.grad) for a, b in zip(grads, plain))
    x3 = leaves[0].detach().reshape(2, 20, -1)
    y3, ss3 = coda.ops.mlp(x3, *(t.detach() for t in leaves[1:]), return_sumsq=True)
    assert ss3.shape == (2, 20) and torch.equal(ss3.reshape(-1), ss)
    with pytest.raises(ValueError, match="residual=True"):
        coda.ops.mlp(*leaves, residual=False, return_sumsq=True)
    with pytest.raises(TypeError, match="return_sumsq"):
        coda.ops.mlp(*leaves, return_sumsq=1)


def test_normed_from_the_producer():
    """normed=(x * gamma, sumsq): the gate/up GEMM reads the given product and takes r from the sums (no scale_sumsq
    pass): y and the gradients as without (the backward differentiates through x and gamma); ignored where gamma is
    folded into the weight (M > 2I); argument errors."""
    leaves = _inputs(M=40)
    x, gamma = (t.detach() for t in leaves[:2])
    hg = (x.float() * gamma).to(x.dtype)
    ss = x.double().pow(2).sum(-1).float()
    dy = torch.randn(40, x.shape[1]).bfloat16()
    y = coda.ops.mlp(*leaves, normed=(hg, ss))
    y.backward(dy)
    plain = _inputs(M=40)
    y0 = coda.ops.mlp(*plain)
    y0.backward(dy)
    torch.testing.assert_close(y, y0, rtol=1e-2, atol=1e-2)
    for a, b in zip(leaves, plain):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)
    with pytest.raises(TypeError, match="normed"):
        coda.ops.mlp(*leaves, normed=hg)
    with pytest.raises(ValueError, match="normed"):
        coda.ops.mlp(*leaves, normed=(hg[:10], ss))
    wide = _inputs(M=200, I=16)  # M > 2I: the folded-weight branch reads x itself
    xw, gw = (t.detach() for t in wide[:2])
    yw = coda.ops.mlp(*wide, normed=(torch.zeros_like(xw), torch.zeros(200)))
    assert torch.equal(yw, coda.ops.mlp(*wide))
