"""Issue 26, "Wrong results" and the DSL's smaller ones, on the CPU (reference path): max-reduction gradients on
ties, the repeat-call fast path's checks, IEEE semantics of the traced math (forward and backward), results lost
(reductions only, reductions named out), constant domain errors, and the DSL's error messages."""
import math
import types
import warnings

import pytest
import torch

import coda
import coda.ops
import importlib
gemm_mod = importlib.import_module("coda.gemm")
from coda.autodiff import backward_epilogue, grad_name
from coda.dsl import EpilogueError

NAN, INF = math.nan, math.inf


def same(got, want):
    """Equal, NaN where NaN (float64 reference checks: the reference path computes what torch computes)."""
    got, want = got.double(), want.double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
    torch.testing.assert_close(got.nan_to_num(0.0), want.nan_to_num(0.0), rtol=1e-12, atol=0.0)


# ---------------------------------------------------------------------------------------- max gradient on ties
@coda.epilogue
def with_max(acc):
    return {"out": acc, "mx": coda.reduce_n(acc, "max")}


@pytest.mark.parametrize("save_preact", [False, True])
def test_max_gradient_splits_exact_ties_only(save_preact):
    """Row 0: logits 1000, 1000.03125 (distinct; equal in bf16, the saved pre-activation's dtype), 1000; row 1: a
    three-way tie (each gets 1/3, as torch's amax); row 2: a unique max."""
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    x[0, 0], x[0, 1], x[1, 0], x[2, 0], x[2, 1] = 1000.0, 0.03125, 5.0, 1.0, 2.0
    w = torch.zeros(8, 8, dtype=torch.bfloat16)
    w[:3, 0] = 1.0
    w[1, 1] = 1.0  # weight rows 0 and 2 are equal
    x.requires_grad_()
    w.requires_grad_()
    res = coda.ops.linear(x, w, epilogue=with_max, save_preact=save_preact)
    res["mx"].sum().backward()
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    (x64 @ w64.T).amax(-1).sum().backward()
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=8e-3, atol=0.0)  # bf16 gradients
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=8e-3, atol=0.0)
    assert w.grad[0, 0].item() == w.grad[2, 0].item() == pytest.approx(5 / 3, rel=8e-3)


def test_tie_shares_nan_and_inf_rows():
    from coda.autodiff import tie_shares
    v = torch.tensor([[1.0, 3.0, 3.0], [NAN, 1.0, 2.0], [-INF, -INF, -INF], [2.0, 2.0 + 2 ** -22, 2.0]], dtype=torch.float64)
    want = torch.tensor([[0, 0.5, 0.5], [NAN, NAN, NAN], [1 / 3] * 3, [0, 1, 0]], dtype=torch.float64)
    same(tie_shares(v), want)


# ---------------------------------------------------------------------------- the repeat-call fast path's checks
@coda.epilogue
def add_tile(acc, r: coda.TileMN):
    return acc + r


def _fake_plan(monkeypatch, a, b, out):
    """A launch plan as _make_plan builds it for ``add_tile`` (operands passed as they are), launching nothing."""
    from coda import _launch
    from coda._validate import check_gemm_args
    launched = []
    monkeypatch.setattr(_launch, "stream_handle", lambda index: 0)
    plan = types.SimpleNamespace(
        prob=check_gemm_args(a, b, out=out, out_dtype=None, half_out=False), epi=add_tile, device_index=0,
        cfg=types.SimpleNamespace(sched="static"), operand_names=("r",), tensor_operands=("r",), has_epi_args=True,
        extents=(_launch.byte_extent(a), _launch.byte_extent(b), _launch.byte_extent(out)), zero_elems=0,
        operand_extents=(("r", _launch.byte_extent(out)),), aliases_ok=set(),  # r: out's shape and strides
        launch=lambda ptrs, handle: launched.append(ptrs))
    return plan, launched


def test_plan_fast_path_checks_out_against_operands(monkeypatch):
    M, N, K = 16, 32, 16
    a, b = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16()
    buf = torch.zeros(2 * M * N, dtype=torch.bfloat16)
    out = buf[:M * N].view(M, N)
    plan, launched = _fake_plan(monkeypatch, a, b, out)
    assert gemm_mod._run_plan(plan, a, b, out, {"r": torch.zeros(M, N).bfloat16()}) is out  # no overlap: fast
    r = buf[N:N + M * N].view(M, N)  # overlaps out (one row later): the full path refuses it
    with pytest.raises(ValueError, match="share memory with operand"):
        coda.reference.gemm(a, b, epilogue=add_tile, out=out, r=r)
    assert gemm_mod._run_plan(plan, a, b, out, {"r": r}) is None  # falls back to the full path's error
    assert gemm_mod._run_plan(plan, a, b, out, {"r": out}) is out  # add-to-output stays allowed
    assert len(launched) == 2


# ------------------------------------------------------------------------------------------------ IEEE semantics
ACC = torch.tensor([[NAN, INF, -INF, 0.0, -0.0, -1.0, 0.5, 2.0, 1e30, -3e-39]], dtype=torch.float64)

IEEE = {
    "nan_guard": (lambda acc: coda.where(acc == acc, acc, 0.0), lambda x: torch.where(x == x, x, 0.0)),
    "sub_self": (lambda acc: acc - acc + 1, lambda x: x - x + 1),
    "div_self": (lambda acc: acc / acc, lambda x: x / x),
    "times_zero": (lambda acc: acc * 0, lambda x: x * 0),
    "not_gt": (lambda acc: coda.where(~(acc > 0), 1.0, 2.0), lambda x: torch.where(~(x > 0), 1.0, 2.0)),
    "sqrt_sqrt": (lambda acc: coda.sqrt(acc) * coda.sqrt(acc), lambda x: x.sqrt() * x.sqrt()),
    "exp_log": (lambda acc: coda.exp(coda.log(acc)), lambda x: x.log().exp()),
    "square_over": (lambda acc: acc * acc / acc, lambda x: x * x / x),
    "maximum": (lambda acc: coda.maximum(acc, 0.5) + coda.minimum(acc, 0.0),
                lambda x: torch.maximum(x, torch.tensor(0.5, dtype=x.dtype)) + torch.minimum(x, torch.zeros_like(x))),
    "relu_nan": (lambda acc: coda.relu(acc) - coda.relu(acc), lambda x: x.relu() - x.relu()),
}


@pytest.mark.parametrize("name", sorted(IEEE))
def test_forward_computes_what_was_written(name):
    f, ref = IEEE[name]
    epi = coda.epilogue(f, name=name)
    same(epi.reference(ACC)["out"], ref(ACC))


@pytest.mark.parametrize("name", sorted(IEEE))
def test_backward_computes_what_autograd_computes(name):
    f, ref = IEEE[name]
    epi = coda.epilogue(f, name=name)
    acc = ACC[..., :-2]  # (no extreme finite values: their cancellations round differently)
    up = torch.linspace(0.5, 1.5, acc.shape[-1], dtype=torch.float64).reshape(acc.shape)
    x = acc.clone().requires_grad_()
    y = ref(x)
    want = torch.autograd.grad(y, x, up, allow_unused=True)[0] if y.requires_grad else None
    want = torch.zeros_like(acc) if want is None else want
    got = backward_epilogue(epi, ("out",), ()).reference(acc, **{grad_name("out"): up})["out"]
    same(got, want)


def test_semantic_key_still_canonical_for_commuted_operands():
    a = coda.epilogue(lambda acc: coda.exp(acc) * 2 + acc, name="k")
    b = coda.epilogue(lambda acc: acc + 2 * coda.exp(acc), name="k")
    c = coda.epilogue(lambda acc: acc - acc, name="k")
    assert a.key() == b.key() != c.key()


# ---------------------------------------------------------------------------------- constant domain errors
CONSTS = {
    "div_zero": (lambda acc: acc / 0.0, lambda x: x / 0.0),
    "log_negative": (lambda acc: acc + coda.log(-0.25), lambda x: x + math.nan),
    "max_log_zero": (lambda acc: coda.maximum(acc, coda.log(0.0)), lambda x: torch.maximum(x, torch.tensor(-INF))),
    "sqrt_negative": (lambda acc: acc * coda.sqrt(-1.0), lambda x: x * math.nan),
    "zero_times_inf": (lambda acc: acc + 0.0 * coda.exp(1000.0), lambda x: x + math.nan),
}


@pytest.mark.parametrize("name", sorted(CONSTS))
def test_constant_domain_errors_evaluate_as_torch(name):
    f, ref = CONSTS[name]
    epi = coda.epilogue(f, name=name)
    same(epi.reference(ACC)["out"], ref(ACC))
    bwd = backward_epilogue(epi, ("out",), ())  # builds (no late sympy error) and evaluates
    bwd.reference(ACC, **{grad_name("out"): torch.ones_like(ACC)})


# -------------------------------------------------------------------------------------------------- results lost
def test_linear_with_only_a_reduction():
    @coda.epilogue
    def only_sum(acc):
        return {"s": coda.reduce_n(acc)}
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    res = coda.ops.linear(x, w, epilogue=only_sum)
    assert set(res) == {"s"}
    want = (x.detach().double() @ w.detach().double().T).sum(-1)
    torch.testing.assert_close(res["s"].double(), want, rtol=1e-5, atol=1e-4)
    res["s"].sum().backward()
    torch.testing.assert_close(x.grad.double(), w.detach().double().sum(0).expand(4, 16), rtol=1e-2, atol=1e-2)


def test_reduction_named_out_is_refused():
    with pytest.raises(EpilogueError, match="'out' is the main M x N output"):
        @coda.epilogue
        def bad(acc):
            return {"out": coda.reduce_n(acc)}


# ------------------------------------------------------------------------------------------ the DSL's messages
def test_builtin_max_points_at_coda_maximum():
    with pytest.raises(EpilogueError, match=r"coda\.maximum") as e:
        @coda.epilogue
        def bad(acc):
            return max(acc, 0)
    assert "control flow" not in str(e.value)
    with pytest.raises(EpilogueError, match=r"coda\.minimum"):
        coda.epilogue(lambda acc: min(acc, 1.0), name="bad_min")
    with pytest.raises(EpilogueError, match="control flow"):
        coda.epilogue(lambda acc: acc if acc > 0 else 0.0, name="bad_if")


def test_torch_function_is_a_classmethod():
    from coda.dsl import Value
    assert isinstance(Value.__dict__["__torch_function__"], classmethod)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(EpilogueError, match="torch.exp cannot take a traced value"):
            coda.epilogue(lambda acc: torch.exp(acc), name="bad_torch")


@pytest.mark.parametrize("value", [torch.tensor(2), torch.tensor(True), torch.tensor(1 + 2j)],
                         ids=["int", "bool", "complex"])
def test_scalar_operand_refuses_non_float_tensors(value):
    @coda.epilogue
    def scaled(acc, s: coda.Scalar):
        return acc * s
    a, b = torch.randn(4, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    with pytest.raises(TypeError, match="floating-point"):
        coda.reference.gemm(a, b, epilogue=scaled, s=value)
    coda.reference.gemm(a, b, epilogue=scaled, s=torch.tensor(2.0))


@pytest.mark.parametrize("name", ["grad_out", "value_mx", "tie_mx"])
def test_backward_operand_names_refused_at_decoration(name):
    ns = {"coda": coda}
    with pytest.raises(EpilogueError, match="reserved for the derived backward"):
        exec(f"@coda.epilogue\ndef e(acc, {name}: coda.VecN):\n    return acc + {name}", ns)


# ------------------------------------------------------------------------ comparisons with a coda.where value
# Found by test_dsl.py::test_generated_gradients_match_autograd: a condition comparing with a where value (a
# Piecewise) made sympy's ExprCondPair fold and rewrite it as an ITE even unevaluated ("KeyError: 'pop from an
# empty set'"): in coda.where's trace (1) and in the backward of minimum (2). coda.dsl.Piecewise keeps them as given.
WG = ("b", "where_gt", ("const", 0.0), ("u", "sq", ("leaf", "acc")))  # where(0 > acc^2, 0, acc^2 - 0)
NESTED_WHERE = {
    "where_of_where": ("b", "where_gt", ("leaf", "acc"), WG),
    "minimum_of_where": ("b", "minimum", ("leaf", "acc"), WG),
    "maximum_of_where": ("b", "maximum", WG, ("leaf", "acc")),
}


@pytest.mark.parametrize("name", sorted(NESTED_WHERE))
def test_comparison_with_a_where_value_traces_and_differentiates(name):
    from gen_epilogues import make_epilogue, torch_eval
    spec = dict(kinds={}, main=NESTED_WHERE[name], extras={}, reds={}, pairs=None)
    epi = make_epilogue(spec)
    # ties of acc with acc^2 (0, 1: torch.minimum / maximum split the gradient), NaN, inf, and random values
    acc = torch.cat([torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, NAN, INF, -INF], dtype=torch.float64),
                     torch.randn(27, generator=torch.Generator().manual_seed(3), dtype=torch.float64)]).reshape(4, 9)
    up = torch.linspace(0.5, 1.5, acc.numel(), dtype=torch.float64).reshape(acc.shape)
    x = acc.clone().requires_grad_()
    y = torch_eval(spec, x, {})["out"]
    same(epi.reference(acc)["out"], y.detach())
    want = torch.autograd.grad(y, x, up)[0]
    got = backward_epilogue(epi, ("out",), ()).reference(acc, **{grad_name("out"): up})["out"]
    same(got, want)


def test_sin_of_a_product_with_a_constant_expression_factor():
    """Found by test_dsl.py::test_generated_reference_matches_torch: sin(2 tanh(g) tanh(sigmoid(0.0))); the constant
    factor, built unevaluated, has no float in sympy (coda/_eval.py: ProductAngle evaluates it as a factor)."""
    epi = coda.epilogue(lambda acc: coda.sin(2.0 * coda.tanh(acc) * coda.tanh(coda.sigmoid(0.0))), name="sin_c")
    acc = torch.randn(3, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    want = torch.sin(2.0 * torch.tanh(acc) * torch.tanh(torch.sigmoid(torch.tensor(0.0, dtype=torch.float64))))
    torch.testing.assert_close(epi.reference(acc)["out"], want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------- the backward operands of max / logsumexp, as the GPU tests form them
TIES = {  # small integer GEMMs: exact accumulators, many exact ties (minimum(acc, 1) ties wherever acc >= 1)
    "plain": dict(kinds={}, main=("leaf", "acc"), extras={}, pairs=None,
                  reds={"r0": ("n", "max", ("b", "minimum", ("leaf", "acc"), ("const", 1.0))),
                        "r1": ("n", "logsumexp", ("b", "mul", ("leaf", "acc"), ("const", 0.25))),
                        "r2": ("n", "max", ("u", "sq", ("leaf", "acc")))}),
    "pairs": dict(kinds={}, main=("leaf", "g"), extras={}, pairs="half",
                  reds={"r0": ("n", "max", ("b", "minimum", ("b", "maximum", ("leaf", "g"), ("u", "relu", ("leaf", "u"))),
                                             ("const", 1.0)))}),
}


@pytest.mark.parametrize("name", sorted(TIES))
def test_gpu_tests_backward_operands_on_the_reference(name):
    """tests/test_dsl_gpu.py's reduction_operands (tie_<r> for max, value_<r> for logsumexp, from the accumulator)
    on coda.reference.gemm, the derived backward vs float64 autograd with torch's amax (ties split exactly)."""
    from gen_epilogues import make_epilogue, torch_eval
    from test_dsl_gpu import reduction_operands
    spec = TIES[name]
    epi = make_epilogue(spec)
    g = torch.Generator().manual_seed(4)
    M, N, K = 6, 16, 8
    a = torch.randint(-2, 3, (M, K), generator=g).to(torch.bfloat16)
    b = torch.randint(-2, 3, (N, K), generator=g).to(torch.bfloat16)
    acc64 = (a.double() @ b.double().T).requires_grad_()
    outs = torch_eval(spec, acc64, {})
    ups = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in outs.items()}
    want = torch.autograd.grad(sum((outs[k] * ups[k]).sum() for k in outs), acc64)[0]
    bwd = backward_epilogue(epi, tuple(outs), ())
    bops = {grad_name(k): u for k, u in ups.items()}
    bops.update(reduction_operands(epi, {})(acc64.detach()))
    assert sorted(k for k in bops if k.startswith("tie_")) == sorted(
        "tie_" + k for k, (_, op, _) in spec["reds"].items() if op == "max")
    got = coda.reference.gemm(a, b, epilogue=bwd, out_dtype=torch.float32, **{k: v.float() for k, v in bops.items()})
    got = got if isinstance(got, dict) else {"out": got}
    torch.testing.assert_close(got["out"].double(), want, rtol=1e-5, atol=1e-5)
