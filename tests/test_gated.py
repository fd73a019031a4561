"""coda.ops.linear_swiglu / linear_geglu on the CPU (the reference path: the same epilogue programs as torch ops):
the derivative algebra checked with sympy on the library epilogues' traced expressions, fwd/bwd vs float64 autograd
of the unfused projection (2x rule), the interleaved weight layout, torch.library.opcheck, torch.compile, errors."""
import importlib
import random

import pytest
import sympy as sp
import torch

import coda
import coda.ops
from coda.autodiff import backward_epilogue, grad_name
from coda.dsl import ACC_EVEN, ACC_ODD, ODD_OUT, Sigmoid, operand_symbol
from coda.epilogues.gated import geglu, geglu_erf, swiglu
from gated_ref import check_against_fp64, ours, unfused

gated = importlib.import_module("coda.ops.gated")  # the module (coda.ops.linear_swiglu is the op)
KINDS = ["swiglu", "geglu_tanh", "geglu_none"]

# ------------------------------------------------------------------------------------ the algebra (sympy)
G, U, DA = ACC_EVEN, ACC_ODD, operand_symbol(grad_name("out"))  # gate, up, the upstream gradient of a


def _documented():
    """(act(g), act'(g)) as written in the epilogues/gated.py docstring."""
    s = Sigmoid(G)
    k, c = sp.sqrt(2 / sp.pi), sp.Float(0.044715)
    t = sp.tanh(k * (G + c * G ** 3))
    phi_cdf = (1 + sp.erf(G / sp.sqrt(2))) / 2
    return {swiglu: (G * s, s * (1 + G * (1 - s))),
            geglu: (G * (1 + t) / 2, (1 + t) / 2 + G / 2 * (1 - t ** 2) * k * (1 + 3 * c * G ** 2)),
            geglu_erf: (G * phi_cdf, phi_cdf + G * sp.exp(-G ** 2 / 2) / sp.sqrt(2 * sp.pi))}


def _explicit(e):
    return e.replace(Sigmoid, lambda q: 1 / (1 + sp.exp(-q)))


@pytest.mark.parametrize("epi", [swiglu, geglu, geglu_erf], ids=lambda e: e.name)
def test_derivative_algebra(epi):
    act, dact = _documented()[epi]
    assert epi.pair_mode == "half"
    assert _equal(epi.exprs["out"], act * U)  # forward: a = act(g) u
    # the documented derivative is the derivative (plain sympy diff of the unfused expression)
    assert sp.simplify(_explicit(DA * U * dact) - sp.diff(_explicit(DA * act * U), G)) == 0
    # the backward epilogue coda.autodiff derives (what the ops run) is dg = da u act'(g), du = da act(g)
    bwd = backward_epilogue(epi, ("out",), ())
    assert bwd.pair_mode == "full" and [o.name for o in bwd.operands] == [grad_name("out")]
    assert _equal(bwd.exprs["out"], DA * U * dact)
    assert _equal(bwd.exprs[ODD_OUT], DA * act)


def _equal(a, b) -> bool:
    """a == b as functions: sympy proves it, or (the tanh form of GELU vs the sigmoid form the epilogue uses,
    which simplify does not always see through) they agree at random points to 1e-12 (the 15-digit sympy Float
    0.044715 times 3 is rounded differently on the two sides)."""
    d = _explicit(a - b)
    if sp.simplify(d) == 0:
        return True
    rng = random.Random(0)
    for _ in range(12):
        pt = {s: sp.Rational(rng.randint(-3000, 3000), 1000) for s in d.free_symbols}
        if abs(sp.N(d.subs(pt), 50)) > 1e-12:
            return False
    return True


# ------------------------------------------------------------------------------ numerics vs float64 autograd
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lead,H,I", [((37,), 40, 24), ((3, 13), 64, 8), ((2, 4, 5), 16, 40), ((1,), 24, 16)])
@pytest.mark.parametrize("save_preact", [True, False])
def test_matches_fp64_autograd(kind, lead, H, I, save_preact):
    check_against_fp64(kind, lead, H, I, save_preact=save_preact)


@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh"])
def test_fp16(kind):
    check_against_fp64(kind, (3, 13), 48, 24, dtype=torch.float16)


@pytest.mark.parametrize("save_preact", [True, False])
@pytest.mark.parametrize("kind,epi", [("swiglu", swiglu), ("geglu_tanh", geglu), ("geglu_none", geglu_erf)])
def test_same_programs_as_ops_linear(kind, epi, save_preact, monkeypatch):
    """The op runs exactly what ``coda.ops.linear(x, weight_gu, epilogue=..., save_preact=...)`` runs (bitwise, fwd
    and bwd); with save_preact the backward's dacc is a K = 0 launch (no recompute GEMM)."""
    torch.manual_seed(0)
    x = torch.randn(2, 11, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(48, 32, dtype=torch.bfloat16) / 6).requires_grad_()
    dy = torch.randn(2, 11, 24, dtype=torch.bfloat16)
    log, real = [], coda.reference.gemm
    monkeypatch.setattr(coda.reference, "gemm",
                        lambda a_, b_, **kw: log.append((getattr(kw.get("epilogue"), "name", None), a_.shape[-1]))
                        or real(a_, b_, **kw))
    a = ours(kind, x, w, save_preact)
    ga = torch.autograd.grad(a, (x, w), dy)
    n = len(log)
    b = coda.ops.linear(x, w, epilogue=epi, save_preact=save_preact)
    assert torch.equal(a, b)
    for g1, g2 in zip(ga, torch.autograd.grad(b, (x, w), dy)):
        assert torch.equal(g1, g2)
    assert log[:n] == log[n:]
    dacc = log[1]
    assert dacc == ((f"{epi.name}_bwd_on_preact", 0) if save_preact else (f"{epi.name}_bwd", 32)), log


def test_no_preact_without_autograd(monkeypatch):
    """save_preact only when autograd records the call: under no_grad the forward stores no pre-activation."""
    log, real = [], coda.reference.gemm
    monkeypatch.setattr(coda.reference, "gemm",
                        lambda a, b, **kw: log.append(kw["epilogue"].name) or real(a, b, **kw))
    x, w = _inputs()
    with torch.no_grad():
        coda.ops.linear_swiglu(x, w)
        coda.ops.linear_geglu(x, w)
    coda.ops.linear_swiglu(x.detach(), w.detach())
    coda.ops.linear_swiglu(x, w)
    assert log == ["swiglu", "geglu", "swiglu", "swiglu_preact"], log


def test_partial_gradients_and_empty_rows():
    torch.manual_seed(0)
    x = torch.randn(9, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 16, dtype=torch.bfloat16)  # frozen: no dW product
    (dx,) = torch.autograd.grad(coda.ops.linear_swiglu(x, w).float().sum(), (x,))
    wg, wu = coda.ops.deinterleave_gate_up(w)
    x64 = x.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(unfused("swiglu", x64, wg.double(), wu.double()).sum(), (x64,))
    torch.testing.assert_close(dx.double(), want, rtol=2e-2, atol=5e-2)
    x0 = torch.randn(0, 16, dtype=torch.bfloat16, requires_grad=True)
    w.requires_grad_()
    y = coda.ops.linear_geglu(x0, w)
    assert y.shape == (0, 8)
    dx0, dw0 = torch.autograd.grad(y.sum(), (x0, w))
    assert dx0.shape == (0, 16) and dw0.shape == (16, 16) and not dw0.any()


# ----------------------------------------------------------------------------------------------- weight layout
def test_interleave_round_trip():
    wg, wu = torch.randn(5, 3), torch.randn(5, 3)
    w = coda.ops.interleave_gate_up(wg, wu)
    assert w.shape == (10, 3) and w.is_contiguous()
    assert torch.equal(w[0], wg[0]) and torch.equal(w[1], wu[0]) and torch.equal(w[9], wu[4])
    g2, u2 = coda.ops.deinterleave_gate_up(w)
    assert torch.equal(g2, wg) and torch.equal(u2, wu)
    assert g2.data_ptr() == w.data_ptr()  # views, no copy
    assert torch.equal(coda.ops.interleave_gate_up(g2, u2), w)
    b = coda.ops.interleave_gate_up(torch.arange(3.0), torch.arange(3.0) + 10)  # 1-D (biases)
    assert b.tolist() == [0, 10, 1, 11, 2, 12]
    # differentiable: a model may keep w_gate / w_up as parameters and interleave per step
    wg.requires_grad_()
    (coda.ops.interleave_gate_up(wg, wu) * torch.arange(10.0).unsqueeze(1)).sum().backward()
    assert torch.equal(wg.grad[:, 0], torch.arange(0.0, 10, 2))


def test_interleave_errors():
    with pytest.raises(ValueError, match="w_gate and w_up must have the same shape"):
        coda.ops.interleave_gate_up(torch.randn(4, 3), torch.randn(5, 3))
    with pytest.raises(TypeError, match="w_up must have w_gate's dtype"):
        coda.ops.interleave_gate_up(torch.randn(4, 3), torch.randn(4, 3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="w_gate must be a torch.Tensor"):
        coda.ops.interleave_gate_up([1.0], torch.randn(1))
    with pytest.raises(ValueError, match="weight_gu must have an even first dim"):
        coda.ops.deinterleave_gate_up(torch.randn(7, 3))


# ---------------------------------------------------------------------------------- torch integration
def _inputs(M=24, H=32, I=16, grad=True):
    torch.manual_seed(0)
    x = torch.randn(M, H, dtype=torch.bfloat16)
    w = torch.randn(2 * I, H, dtype=torch.bfloat16) / H ** 0.5
    return x.requires_grad_(grad), w.requires_grad_(grad)


@pytest.mark.parametrize("save_preact", [True, False])
def test_opcheck(save_preact):
    x, w = _inputs()
    torch.library.opcheck(torch.ops.coda.linear_swiglu.default, (x, w, save_preact))
    for approximate in ("tanh", "none"):
        torch.library.opcheck(torch.ops.coda.linear_geglu.default, (x, w, approximate, save_preact))
    dy = torch.randn(24, 16, dtype=torch.bfloat16)
    _, g, u = torch.ops.coda.linear_swiglu(x.detach(), w.detach(), save_preact)
    assert g.shape == u.shape == ((24, 16) if save_preact else (0,))
    g, u = (g, u) if save_preact else (None, None)
    for kind in KINDS:
        for need in ((True, True), (True, False), (False, True)):
            torch.library.opcheck(torch.ops.coda.linear_gated_backward.default,
                                  (dy, x.detach(), w.detach(), g, u, kind, *need))


def test_torch_compile_fullgraph():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()

    def mlp(x, w_gu, w_down):
        return (coda.ops.linear_swiglu(x, w_gu) @ w_down.T).float().square().sum() + \
            coda.ops.linear_geglu(x, w_gu).float().sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mlp, fullgraph=True, backend=counter)
    for m in (24, 40):
        x, w = _inputs(M=m)
        w_down = (torch.randn(32, 16, dtype=torch.bfloat16) / 4).requires_grad_()
        loss = compiled(x, w, w_down)
        grads = torch.autograd.grad(loss, (x, w, w_down))
        loss_eager = mlp(x, w, w_down)
        want = torch.autograd.grad(loss_eager, (x, w, w_down))
        torch.testing.assert_close(loss, loss_eager)
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b)
    code = counter.graphs[0].code
    assert "torch.ops.coda.linear_swiglu" in code and "torch.ops.coda.linear_geglu" in code  # opaque nodes


# ----------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("x,w,exc,match", [
    ([1.0], None, TypeError, "x must be a torch.Tensor"),
    (None, "w", TypeError, "weight_gu must be a torch.Tensor"),
    (torch.randn(4, 32), None, TypeError, "x must be bfloat16 or float16"),
    (None, torch.randn(32, 32, dtype=torch.float16), TypeError, "weight_gu must have x's dtype"),
    (None, torch.randn(32, 24, dtype=torch.bfloat16), ValueError, r"weight_gu must be \(2I, H\) with H=32"),
    (None, torch.randn(2, 32, 32, dtype=torch.bfloat16), ValueError, r"weight_gu must be \(2I, H\)"),
    (None, torch.randn(33, 32, dtype=torch.bfloat16), ValueError, "weight_gu has 33 rows"),  # odd 2I
    (None, torch.randn(40, 32, dtype=torch.bfloat16), ValueError, r"40 rows.*with I % 8 == 0, i.e. 2I % 16 == 0"),  # I = 20
    (torch.randn(4, 12, dtype=torch.bfloat16), torch.randn(32, 12, dtype=torch.bfloat16), ValueError,
     r"x: H = x.shape\[-1\] = 12 must be a multiple of 8"),
    (None, torch.randn(32, 32, dtype=torch.bfloat16, device="meta"), ValueError, "weight_gu is on meta"),
    (torch.randn(32, 4, dtype=torch.bfloat16).t(), None, ValueError, "x: the last dim must be contiguous"),
    (torch.tensor(1.0, dtype=torch.bfloat16), None, ValueError, r"x must be \(..., H\)"),
])
@pytest.mark.parametrize("op", ["linear_swiglu", "linear_geglu"])
def test_errors_before_compute(monkeypatch, op, x, w, exc, match):
    calls = []
    monkeypatch.setattr(gated, "gemm_for", lambda *a: calls.append(a))
    x = torch.randn(4, 32, dtype=torch.bfloat16) if x is None else x
    w = torch.randn(32, 32, dtype=torch.bfloat16) if w is None else w
    with pytest.raises(exc, match=match) as e:
        getattr(coda.ops, op)(x, w)
    assert str(e.value).startswith(f"{op}: ") and not calls


def test_geglu_approximate_error():
    x, w = _inputs(grad=False)
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none', got 'erf'"):
        coda.ops.linear_geglu(x, w, approximate="erf")


def test_unaligned_width_through_ops_linear():
    """What the library itself says for 2I % 16 != 0 (coda.ops.linear with the epilogue, bypassing the op's
    check): the GEMM's alignment error names N/2; the op says it in terms of I before anything runs."""
    x, w = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(40, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight: N/2=20 \(pairs: half of weight.shape\[0\]\)"):
        coda.ops.linear(x, w, epilogue=swiglu)
    with pytest.raises(ValueError, match="linear_swiglu: weight_gu has 40 rows"):
        coda.ops.linear_swiglu(x, w)


def test_rejects_non_hopper_gpu_before_compute(monkeypatch):
    """The device rule of ops/_common.gemm_for holds for these ops (CPU here: the patched rule raises)."""
    monkeypatch.setattr(gated, "gemm_for", lambda device, entry: (_ for _ in ()).throw(RuntimeError(f"{entry} needs")))
    x, w = _inputs(grad=False)
    with pytest.raises(RuntimeError, match="coda.ops.linear_swiglu needs"):
        coda.ops.linear_swiglu(x, w)
    with pytest.raises(RuntimeError, match="coda.ops.linear_geglu needs"):
        coda.ops.linear_geglu(x, w)


def test_backward_pass_on_preact_compiles_with_deep_rings():
    """The K = 0 backward pass on the saved pre-activation (three TileMN operands, a full-width pairs output) with
    the K = 0 default config (2 stages): 8-deep TMA rings, 4 output buffers; compiles for sm_90a, WGMMA, no
    spills. A K > 0 config deepens its rings only where that costs no pipeline stage."""
    pytest.importorskip("cutlass")
    from coda.check import compile_variant
    from coda.config import default_config
    from coda.kernels.epilogue import staged_smem_bytes, tile_ring, tile_tma_plan
    from coda.ops.linear import backward_of
    epi = backward_of(swiglu, ("out",), (), False, preact=True)
    cfg = default_config(8192, 28672, 0)
    assert cfg.stages == 2
    flags, _ = tile_tma_plan(epi, cfg, (True,) * 3, [2, 2, 2], [2])
    ring = tile_ring(epi, cfg, [2, 2, 2], [2])
    assert all(flags) and ring == 8
    assert cfg.epi_buffers([2], staged_smem_bytes(epi, cfg, [2, 2, 2], ring)) == 4
    k_cfg = default_config(8192, 28672, 4096)
    stages = [k_cfg.derive_stages([2], extra_smem=staged_smem_bytes(epi, k_cfg, [2, 2, 2], r))
              for r in (2, tile_ring(epi, k_cfg, [2, 2, 2], [2]))]
    assert stages[0] == stages[1]
    row = compile_variant(cfg, epi)
    assert row["ok"] and row["wgmma"] > 0 and row["spill_bytes"] == 0, row
