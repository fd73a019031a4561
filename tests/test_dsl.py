"""@coda.epilogue on the CPU: tracing, errors, the semantic key, reference vs torch, sympy gradients vs autograd,
and every generated epilogue compiles for sm_90a."""
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

import coda
import coda.ops
from coda.autodiff import backward_epilogue, grad_name, value_name
from coda.dsl import ODD_OUT
from gen_epilogues import make_epilogue, random_operands, specs, torch_eval
from hook_epilogues import gated_tiles, gated_tiles64, rotate64

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------------------------------------- API
def test_bias_gelu_reference_matches_torch():
    @coda.epilogue
    def bias_gelu(acc, bias: coda.VecN):
        return coda.gelu(acc + bias)

    x = torch.randn(37, 64, dtype=torch.bfloat16)
    w = torch.randn(24, 64, dtype=torch.bfloat16)
    b = torch.randn(24)
    y = coda.reference.gemm(x, w, epilogue=bias_gelu, bias=b, out_dtype=torch.float32)
    ref = torch.nn.functional.gelu(x.float() @ w.float().T + b, approximate="tanh")
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert bias_gelu.operands[0].kind == "vec_n"


def test_dict_outputs_and_reductions():
    @coda.epilogue
    def f(acc, r: coda.VecM, s: coda.Scalar):
        y = acc * r + s
        return {"out": y, "pre": acc, "ss": coda.reduce_n(y * y), "mx": coda.reduce_n(y, "max"),
                "lse": coda.reduce_n(y, "logsumexp"), "cs": coda.reduce_m(y)}

    assert f.outputs == ("pre",)
    assert [(r.name, r.axis, r.op) for r in f.reductions] == [("ss", "n", "sum"), ("mx", "n", "max"),
                                                               ("lse", "n", "logsumexp"), ("cs", "m", "sum")]
    acc = torch.randn(2, 5, 7, dtype=torch.float64)
    r = torch.randn(2, 5, dtype=torch.float64)
    got = f.reference(acc, r=r, s=0.25)
    y = acc * r.unsqueeze(-1) + 0.25
    torch.testing.assert_close(got["ss"], (y * y).sum(-1))
    torch.testing.assert_close(got["lse"], torch.logsumexp(y, -1))
    torch.testing.assert_close(got["cs"], y.sum(-2))
    torch.testing.assert_close(got["pre"], acc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finish_logsumexp_in_place_equals_torch(dtype):
    """kernels.epilogue.finish_reduction's logsumexp (in place over the call's own partials: no temporary of their
    size) is torch.logsumexp bit for bit, rows of -inf, +inf and NaN partials included."""
    from coda.kernels.epilogue import finish_reduction
    p = torch.randn(2, 7, 9, dtype=dtype) * 30
    p[0, :, 0] = -math.inf              # every tile of a row empty
    p[0, 3, 1] = math.inf               # a +inf partial
    p[1, 2, 2] = math.nan
    p[1, :4, 3] = -math.inf
    want = torch.logsumexp(p, dim=1)
    got = finish_reduction(p.clone(), "logsumexp")
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert finish_reduction(torch.empty(1, 0, 4, dtype=dtype), "logsumexp").shape == (1, 4)


def test_no_main_output():
    """A dict without "out": nothing M x N is stored (the LM-head forward keeps only per-row reductions)."""
    @coda.epilogue
    def lse_tgt(acc, t: coda.VecM):
        return {"lse": coda.reduce_n(acc, "logsumexp"), "tgt": coda.reduce_n(coda.where(coda.col() == t, acc, 0.0))}

    assert not lse_tgt.stores_out and lse_tgt.result_keys == ["lse", "tgt"]
    x, w = torch.randn(37, 64, dtype=torch.bfloat16), torch.randn(24, 64, dtype=torch.bfloat16)
    t = torch.randint(0, 24, (37,))
    got = coda.reference.gemm(x, w, epilogue=lse_tgt, t=t.float())
    logits = x.double() @ w.double().T
    assert sorted(got) == ["lse", "tgt"]
    torch.testing.assert_close(got["lse"].double(), logits.logsumexp(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["tgt"].double(), logits.gather(1, t[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    out = torch.full((37, 24), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out: epilogue 'lse_tgt' stores no main output"):
        coda.reference.gemm(x, w, epilogue=lse_tgt, t=t.float(), out=out)
    assert (out == 7).all()
    # the backward of reductions only: d(sum lse - tgt)/dx through coda.ops.linear
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    (torch.logsumexp(xr @ wr.T, -1) - (xr @ wr.T).gather(1, t[:, None])[:, 0]).sum().backward()
    xc, wc = x.float().bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    res = coda.ops.linear(xc, wc, epilogue=lse_tgt, t=t.float())
    (res["lse"] - res["tgt"]).sum().backward()
    for mine, ref in ((xc.grad, xr.grad), (wc.grad, wr.grad)):
        assert ((mine.double() - ref).norm() / ref.norm()).item() < 2e-2

    def empty(acc):
        return {}
    with pytest.raises(coda.EpilogueError, match="empty"):
        coda.epilogue(empty)


def test_pairs_half_and_full():
    """coda.pairs: one value per column pair (N/2 output; SwiGLU) and a 2 -> 2 transform (rotation); backward."""
    from coda.check import compile_variant
    from coda.config import GemmConfig

    from coda.epilogues.gated import swiglu
    from hook_epilogues import rotate as rot

    assert (swiglu.pair_mode, rot.pair_mode) == ("half", "full")
    x, w = torch.randn(2, 24, 32, dtype=torch.bfloat16), torch.randn(64, 32, dtype=torch.bfloat16)
    y = coda.reference.gemm(x, w, epilogue=swiglu, out_dtype=torch.float32)
    h = x.float() @ w.float().T
    assert y.shape == (2, 24, 32)
    torch.testing.assert_close(y, torch.nn.functional.silu(h[..., 0::2]) * h[..., 1::2])
    th = torch.rand(2, 24, 32) * 6
    z = coda.reference.gemm(x, w, epilogue=rot, c=th.cos(), s=th.sin(), out_dtype=torch.float32)
    torch.testing.assert_close(z[..., 0::2], h[..., 0::2] * th.cos() - h[..., 1::2] * th.sin())
    torch.testing.assert_close(z[..., 1::2], h[..., 0::2] * th.sin() + h[..., 1::2] * th.cos())
    with pytest.raises(ValueError, match="must be even"):
        coda.reference.gemm(x, w[:63], epilogue=swiglu)
    with pytest.raises(ValueError, match="expected shape"):
        coda.reference.gemm(x, w, epilogue=rot, c=th.cos()[..., :16], s=th.sin())
    bwd = backward_epilogue(swiglu, ("out",), ())
    acc = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 4, dtype=torch.float64)
    (torch.nn.functional.silu(acc[:, 0::2]) * acc[:, 1::2] * g).sum().backward()
    torch.testing.assert_close(bwd.reference(acc.detach(), grad_out=g)["out"], acc.grad)
    # 2 -> 2 backward through coda.ops.linear (the rotation's angle tables need no gradient) vs float64 autograd
    xr = torch.randn(2, 24, 32, dtype=torch.bfloat16, requires_grad=True)
    wr = (torch.randn(64, 32, dtype=torch.bfloat16) * 0.2).requires_grad_()
    up = torch.randn(2, 24, 64, dtype=torch.float64)
    got = torch.autograd.grad((coda.ops.linear(xr, wr, epilogue=rot, c=th.cos(), s=th.sin()).double() * up).sum(),
                              [xr, wr])
    x64, w64 = xr.detach().double().requires_grad_(), wr.detach().double().requires_grad_()
    h64 = x64 @ w64.T
    c64, s64 = th.cos().double(), th.sin().double()
    z64 = torch.stack((h64[..., 0::2] * c64 - h64[..., 1::2] * s64, h64[..., 0::2] * s64 + h64[..., 1::2] * c64),
                      -1).reshape(h64.shape)
    want = torch.autograd.grad((z64 * up).sum(), [x64, w64])
    for g_, w_ in zip(got, want):
        assert ((g_.double() - w_).norm() / w_.norm()).item() < 1e-2
    rot_bwd = backward_epilogue(rot, ("out",), ())
    assert rot_bwd.pair_mode == "full" and [o.name for o in rot_bwd.operands][-2:] == ["grad_out", "grad_out_odd_"]
    with pytest.raises(NotImplementedError, match="TileMN operand 'c' of a pairs epilogue"):
        backward_epilogue(rot, ("out",), ("c",))
    with pytest.raises(ValueError, match="2 -> 2 .* extra outputs.* save_preact=False"):  # (half mode: supported)
        coda.ops.linear(xr, wr, epilogue=rot, save_preact=True, c=th.cos(), s=th.sin())
    for epi in (swiglu, rot, bwd, rot_bwd):  # (rot_bwd's 4 tile loads per pair spill on 128x128 ping-pong)
        r = compile_variant(GemmConfig(tile_m=128, tile_n=128, cluster_m=1), epi)
        assert r["ok"], r

    def mixed(acc):
        g, u = coda.pairs(acc)
        return g * u + acc
    with pytest.raises(coda.EpilogueError, match="both coda.pairs"):
        coda.epilogue(mixed)

    def three(acc):
        g, u = coda.pairs(acc)
        return g, u, g
    with pytest.raises(coda.EpilogueError, match="tuple of two"):
        coda.epilogue(three)


def test_pairs_reductions_and_operand_grads():
    """Reductions in a pairs epilogue run over one value per pair (reduce_m gives N/2 values); the backward gives
    VecN / VecM gradients per pair (reduce_m / reduce_n in a 2 -> 2 pairs backward epilogue)."""
    from coda.check import compile_variant
    from coda.config import GemmConfig
    from hook_epilogues import scaled_swiglu_stats as epi
    x, w = torch.randn(40, 32, dtype=torch.bfloat16), torch.randn(64, 32, dtype=torch.bfloat16)
    s, r = torch.rand(32) + 0.5, torch.rand(40) + 0.5
    got = coda.reference.gemm(x, w, epilogue=epi, out_dtype=torch.float32, s=s, r=r)
    h = x.double() @ w.double().T
    g, u = h[..., 0::2], h[..., 1::2]
    y = torch.nn.functional.silu(g) * u * s.double() * r.double().unsqueeze(-1)
    want = {"out": y, "ss": (y * y).sum(-1), "mx": g.amax(-1), "cs": (u * s.double()).sum(-2),
            "lse": torch.logsumexp(g * r.double().unsqueeze(-1), -1)}
    assert got["cs"].shape == (32,) and got["ss"].shape == (40,)
    for k, v in want.items():
        assert ((got[k].double() - v).norm() / v.norm()).item() < 1e-5, k
    # backward through coda.ops.linear (reference path on the CPU) vs float64 autograd: x, w, s and r
    xr, wr = x.clone().requires_grad_(), (w * 0.2).requires_grad_()
    sr, rr = s.clone().requires_grad_(), r.clone().requires_grad_()
    res = coda.ops.linear(xr, wr, epilogue=epi, s=sr, r=rr)
    ups = {k: torch.randn(v.shape, dtype=torch.float64) for k, v in res.items() if k != "mx"}
    loss = sum((res[k].double() * u_).sum() for k, u_ in ups.items())
    got_g = torch.autograd.grad(loss, [xr, wr, sr, rr])
    x64, w64, s64, r64 = (t.detach().double().requires_grad_() for t in (xr, wr, sr, rr))
    h = x64 @ w64.T
    g, u = h[..., 0::2], h[..., 1::2]
    y = torch.nn.functional.silu(g) * u * s64 * r64.unsqueeze(-1)
    outs = {"out": y, "ss": (y * y).sum(-1), "cs": (u * s64).sum(-2), "lse": torch.logsumexp(g * r64.unsqueeze(-1), -1)}
    want_g = torch.autograd.grad(sum((outs[k] * u_).sum() for k, u_ in ups.items()), [x64, w64, s64, r64])
    for name, a_, b_ in zip("xwsr", got_g, want_g):
        assert ((a_.double() - b_).norm() / b_.norm()).item() < 2e-2, name
    bwd = backward_epilogue(epi, ("out", "ss", "cs", "lse"), ("s", "r"))
    assert bwd.pair_mode == "full" and {x.name for x in bwd.reductions} == {"d_s", "d_r"}
    for e in (epi, bwd):
        row = compile_variant(GemmConfig(tile_m=128, tile_n=256, cluster_m=1), e)
        assert row["wgmma"] > 0, row["error"]


def test_row_col_and_where():
    @coda.epilogue
    def causal(acc):
        return coda.where(coda.col() <= coda.row(), acc, -1e4)

    acc = torch.randn(6, 6, dtype=torch.float64)
    got = causal.reference(acc)["out"]
    torch.testing.assert_close(got, torch.where(torch.ones(6, 6).tril().bool(), acc, torch.tensor(-1e4).double()))


def test_semantic_key():
    def mk(body):
        ns = {"coda": coda}
        exec(f"@coda.epilogue\ndef e(acc, bias: coda.VecN):\n{body}", ns)
        return ns["e"]

    a = mk("    return coda.silu(acc + bias)")
    b = mk("    t = bias + acc\n    return coda.silu(t)")  # renamed local, commuted sum
    c = mk("    return coda.silu(acc - bias)")
    d = mk("    return coda.sigmoid(acc + bias)")
    assert a.key() == b.key()
    assert len({a.key(), c.key(), d.key()}) == 3
    assert hash(a.key()) == hash(b.key())


def test_fastmath_is_in_the_key_and_carries_to_derived_programs():
    """``@coda.epilogue(fastmath=True)``: a different program (key, custom-op name) than the same function without
    it, the same reference; every program derived from it (backward, TileMN gradients of pairs, max ties, saved
    pre-activation, on the pre-activation, on the accumulator) divides and roots the same way."""
    from coda.autodiff import on_acc, on_preact, pair_tile_grad_epilogue, tie_epilogue, with_preact

    def f(acc, d: coda.VecN, t: coda.TileMN):
        y = acc / d + coda.sqrt(t * t + 1.0)
        return {"out": y, "mx": coda.reduce_n(y, "max")}
    fast, ieee = coda.epilogue(f, fastmath=True), coda.epilogue(f)
    assert fast.fastmath and not ieee.fastmath and fast.key() != ieee.key() and fast.op_name != ieee.op_name
    acc, d, t = torch.randn(5, 7, dtype=torch.float64), torch.rand(7, dtype=torch.float64) + 0.5, torch.randn(5, 7)
    r_fast, r_ieee = fast.reference(acc, d=d, t=t.double()), ieee.reference(acc, d=d, t=t.double())
    assert all(torch.equal(r_fast[k], r_ieee[k]) for k in r_ieee)
    bwd = backward_epilogue(fast, ("out",), ("d", "t"))
    assert bwd.fastmath and not backward_epilogue(ieee, ("out",), ("d", "t")).fastmath
    assert tie_epilogue(fast, ("mx",)).fastmath and with_preact(fast).fastmath

    @coda.epilogue(fastmath=True)
    def rot(acc, c: coda.TileMN):
        x, y = coda.pairs(acc)
        return x / c - y, x + coda.sqrt(y * y + c)
    rb = backward_epilogue(rot, ("out",), ())
    assert rb.fastmath and pair_tile_grad_epilogue(rot, ("out",), ("c",)).fastmath

    @coda.epilogue(fastmath=True)
    def gate(acc, s: coda.VecM):
        g, u = coda.pairs(acc)
        return g * u / (s + coda.sqrt(g * g))
    pre = on_preact(backward_epilogue(gate, ("out",), ("s",)), gate)
    assert pre.fastmath and on_acc(pre, grad_name("out")).fastmath


# ------------------------------------------------------------------------------------------------- errors
def _raises(src, match):
    ns = {"coda": coda, "math": math, "torch": torch}
    with pytest.raises(coda.EpilogueError, match=match):
        exec(src, ns)


def test_error_python_if_names_line_and_points_to_where():
    _raises("@coda.epilogue\ndef relu_if(acc):\n    if acc > 0:\n        return acc\n    return 0.0\n",
            r"relu_if.*line 3.*coda\.where")


def test_error_unannotated_and_bad_annotation():
    _raises("@coda.epilogue\ndef e(acc, bias):\n    return acc + bias\n", r"'bias' has no annotation")
    _raises("@coda.epilogue\ndef e(acc, bias: int):\n    return acc + bias\n", r"unsupported annotation")


def test_error_unknown_function():
    _raises("@coda.epilogue\ndef e(acc):\n    return math.exp(acc)\n", r"line 3.*coda math functions")
    _raises("@coda.epilogue\ndef e(acc):\n    return torch.exp(acc)\n", r"line 3.*torch\.exp")


def test_error_output_shape():
    _raises("@coda.epilogue\ndef e(acc):\n    return coda.reduce_n(acc)\n", r"'out' is a reduction")
    _raises("@coda.epilogue\ndef e(acc):\n    return {}\n", r"empty")
    _raises("@coda.epilogue\ndef e(acc):\n    return acc, acc\n", r"tuple of two outputs needs coda.pairs")
    _raises("@coda.epilogue\ndef e(acc):\n    return acc, acc, acc\n", r"a tuple of two is a 2 -> 2 pairs output")
    _raises("@coda.epilogue\ndef e(acc):\n    return coda.reduce_n(acc) + 1\n", r"can only be returned")
    _raises("@coda.epilogue\ndef e(acc):\n    return acc ** 0.5\n", r"integer powers")


def test_call_time_operand_errors():
    @coda.epilogue
    def e(acc, bias: coda.VecN, r: coda.VecM):
        return acc * r + bias

    x = torch.randn(8, 16, dtype=torch.bfloat16)
    w = torch.randn(24, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"missing operands \['r'\]"):
        coda.reference.gemm(x, w, epilogue=e, bias=torch.randn(24))
    with pytest.raises(ValueError, match=r"operand 'bias' \(VecN\): expected shape \(24,\)"):
        coda.reference.gemm(x, w, epilogue=e, bias=torch.randn(8), r=torch.randn(8))
    with pytest.raises(TypeError, match=r"operand 'r'.*dtype"):
        coda.reference.gemm(x, w, epilogue=e, bias=torch.randn(24), r=torch.ones(8, dtype=torch.int32))
    with pytest.raises(TypeError, match="unexpected"):
        coda.reference.gemm(x, w, epilogue=e, bias=torch.randn(24), r=torch.randn(8), z=1.0)


# ------------------------------------------------------------------------------------------------- generated
def test_nested_where_does_not_hit_sympy_piecewise_recursion():
    """Found by the generated test below: sympy's Piecewise.eval recursed without end on this nested condition
    (coda.where now builds it unevaluated when that happens); the program still matches torch."""
    wg = lambda a, b: ("b", "where_gt", a, b)  # noqa: E731
    col, p2 = ("leaf", "col"), ("leaf", "p2")
    spec = {"kinds": {"p0": "scalar", "p1": "vec_n", "p2": "scalar"},
            "main": wg(wg(wg(col, p2), wg(col, col)), col), "extras": {}, "reds": {}, "pairs": "full",
            "main_odd": p2}
    epi = make_epilogue(spec)
    g = torch.Generator().manual_seed(0)
    acc = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    ops = random_operands(spec, 2, 5, 6, gen=g)
    got, want = epi.reference(acc, **ops), torch_eval(spec, acc, ops)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-9)


@settings(max_examples=int(os.environ.get("CODA_DSL_EXAMPLES", 200)), **SETTINGS)
@given(spec=specs())
def test_generated_reference_matches_torch(spec):
    check_generated_reference(spec)


def check_generated_reference(spec):
    """The traced epilogue's torch reference equals the recipe's direct torch evaluation (float64)."""
    epi = make_epilogue(spec)
    g = torch.Generator().manual_seed(0)
    L, M, N = 2, 5, 6
    acc = torch.randn(L, M, N, generator=g, dtype=torch.float64)
    ops = random_operands(spec, L, M, N, gen=g)
    got = epi.reference(acc, **ops)
    want = torch_eval(spec, acc, ops)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-9, msg=lambda m: f"{k}: {m}")


@settings(max_examples=int(os.environ.get("CODA_DSL_EXAMPLES", 200)), **SETTINGS)
@given(spec=specs())
def test_generated_gradients_match_autograd(spec):
    # max reductions of expressions constant along a row tie; their gradient convention differs from torch's
    assume(all(op != "max" for (_, op, _) in spec["reds"].values()))
    check_generated_gradients(spec)


def check_generated_gradients(spec):
    """The sympy-derived backward program (float64 reference) equals torch autograd of the recipe."""
    epi = make_epilogue(spec)
    g = torch.Generator().manual_seed(1)
    M, N = 5, 6
    acc = torch.randn(M, N, generator=g, dtype=torch.float64, requires_grad=True)
    ops = random_operands(spec, None, M, N, gen=g)
    tens = {k: (torch.tensor(v, dtype=torch.float64) if spec["kinds"][k] == "scalar" else v).requires_grad_()
            for k, v in ops.items()}
    outs = torch_eval(spec, acc, tens)
    ups = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in outs.items()}
    loss = sum((outs[k] * ups[k]).sum() for k in outs) + 0 * acc.sum()
    wrt = [acc, *tens.values()]
    want = torch.autograd.grad(loss, wrt, allow_unused=True)
    pairs = spec.get("pairs")
    # (a TileMN operand's gradient of a pairs epilogue is not supported: it would be a half-width tile next to dacc)
    needs = tuple(k for k in tens if not (pairs and spec["kinds"][k] == "tile"))
    bwd = backward_epilogue(epi, tuple(outs), needs)
    bops = dict(ops)
    for k, u in ups.items():
        if pairs == "full":  # the gradient of a 2 -> 2 output arrives as even / odd per-pair tiles
            bops[grad_name(k)], bops[grad_name(ODD_OUT)] = u[..., 0::2], u[..., 1::2]
        else:
            bops[grad_name(k)] = u
    fwd = epi.reference(acc.detach(), **ops)
    for r in epi.reductions:
        if r.op != "sum":
            bops[value_name(r.name)] = fwd[r.name]
    got = bwd.reference(acc.detach(), **bops)
    torch.testing.assert_close(got["out"], want[0] if want[0] is not None else torch.zeros_like(acc),
                               rtol=1e-7, atol=1e-9)
    for (name, kind), w in zip(spec["kinds"].items(), want[1:]):
        if name not in needs:
            continue
        d = got["d_" + name]
        if kind == "scalar":
            d = d.sum()
        w = torch.zeros_like(d) if w is None else w
        torch.testing.assert_close(d, w.reshape(d.shape), rtol=1e-7, atol=1e-9, msg=lambda m: f"d_{name}: {m}")


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("CODA_DSL_COMPILE_EXAMPLES", 200)), **SETTINGS)
@given(spec=specs())
def test_generated_epilogue_compiles_for_sm90(spec):
    from coda.check import compile_variant
    from coda.config import GemmConfig
    epi = make_epilogue(spec)
    row = compile_variant(GemmConfig(tile_m=128, tile_n=128, cluster_m=1, pingpong=False), epi)
    # spills are allowed for heavy random epilogues (coda.check reports them); a failed build is not
    assert row["wgmma"] > 0, row["error"]


# ------------------------------------------------------------------------------- TileMN gradients of pairs epilogues
@coda.epilogue
def _plain_tile(acc, t: coda.TileMN):
    return acc * t


def test_pairs_tile_operand_gradients(monkeypatch):
    """TileMN operands of pairs epilogues (one value per pair, M x N/2) get gradients: a second, "half" pairs
    epilogue derived by sympy (coda.autodiff.pair_tile_grad_epilogue) next to the 2 -> 2 dacc epilogue. Half mode
    (with VecN / VecM operands, an extra output, reductions) and 2 -> 2 (rotation): the derived program in float64
    vs autograd; coda.ops.linear on the CPU reference path (which runs the derived program: checked by spying on
    the GEMMs) vs float64 autograd; the preact branch; the derived epilogues compile for sm_90a."""
    import sys

    from coda.autodiff import pair_tile_grad_epilogue, pair_tile_operands
    from coda.check import compile_variant
    from coda.config import GemmConfig
    from hook_epilogues import rotate

    mod = sys.modules["coda.ops.linear"]
    real = mod.gemm_for
    assert pair_tile_operands(gated_tiles, ("p", "s", "q", "r")) == ("p", "q")
    with pytest.raises(ValueError, match="takes TileMN operands"):
        pair_tile_grad_epilogue(gated_tiles, ("out",), ("s",))
    with pytest.raises(ValueError, match="not a pairs epilogue"):
        pair_tile_grad_epilogue(_plain_tile, ("out",), ("t",))
    gen = torch.Generator().manual_seed(3)
    M, N = 6, 32
    cases = [
        (gated_tiles, gated_tiles64, ("p", "q", "s", "r"),
         {"p": torch.randn(2, M, N // 2, generator=gen), "q": torch.randn(2, M, N // 2, generator=gen),
          "s": torch.rand(N // 2, generator=gen) + 0.5, "r": torch.rand(2, M, generator=gen) + 0.5}),
        (rotate, rotate64, ("c", "s"),
         {"c": (th := torch.rand(2, M, N // 2, generator=gen) * 6).cos(), "s": th.sin()}),
    ]
    for epi, model, names, ops in cases:
        tiles = pair_tile_operands(epi, names)
        # 1. the derived program itself, float64, vs autograd (acc as a float64 "pre-activation")
        # (unbatched: a batched reduce_m is per batch, its upstream gradient no VecN)
        acc = torch.randn(M, N, generator=gen, dtype=torch.float64, requires_grad=True)
        t64 = {k: (v[0] if v.dim() > 1 else v).double().requires_grad_() for k, v in ops.items()}
        outs = model(acc, **t64)
        ups = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in outs.items()}
        want = torch.autograd.grad(sum((outs[k] * ups[k]).sum() for k in outs), [t64[n] for n in tiles])
        tepi = pair_tile_grad_epilogue(epi, tuple(outs), tiles)
        assert tepi.pair_mode == "half" and tepi.stores_out and tepi.outputs == tuple("d_" + n for n in tiles[1:])
        bops = {k: v.detach() for k, v in t64.items()}
        for k, u in ups.items():
            if epi.pair_mode == "full":
                bops[grad_name(k)], bops[grad_name(ODD_OUT)] = u[..., 0::2], u[..., 1::2]
            else:
                bops[grad_name(k)] = u
        for red in epi.reductions:
            if red.op != "sum":
                bops[value_name(red.name)] = outs[red.name].detach()
        got = tepi.reference(acc.detach(), **bops)
        for i, (n, w_) in enumerate(zip(tiles, want)):
            torch.testing.assert_close(got["out" if i == 0 else "d_" + n], w_, rtol=1e-9, atol=1e-9)
        # 2. coda.ops.linear (CPU: coda.reference.gemm runs the derived programs) vs float64 autograd
        launched = []

        def spy(*a, **k):
            gemm = real(*a, **k)
            return lambda *x, **y: launched.append(y["epilogue"]) or gemm(*x, **y)
        monkeypatch.setattr(mod, "gemm_for", spy)
        x = torch.randn(2, M, 32, generator=gen).bfloat16().requires_grad_()
        w = (torch.randn(N, 32, generator=gen) * 0.3).bfloat16().requires_grad_()
        leaves = {k: v.clone().requires_grad_() for k, v in ops.items()}
        res = coda.ops.linear(x, w, epilogue=epi, **leaves)
        res = res if isinstance(res, dict) else {"out": res}
        ups = {k: torch.randn(v.shape, generator=gen).bfloat16().double() for k, v in res.items()}  # exact in bf16
        loss = sum((res[k].double() * ups[k]).sum() for k in res)
        got = torch.autograd.grad(loss, [x, w, *leaves.values()])
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        l64 = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
        outs = model(x64 @ w64.T, **l64)
        want = torch.autograd.grad(sum((outs[k] * ups[k]).sum() for k in outs), [x64, w64, *l64.values()])
        for n, a_, b_ in zip(["x", "w", *leaves], got, want):
            assert a_.shape == b_.shape, n
            # tile gradients: fp32 math on the exact inputs; x / w: from dacc rounded to bf16
            tol = 1e-5 if n in tiles else 1e-2
            assert ((a_.double() - b_).norm() / b_.norm()).item() < tol, n
        # forward, dacc (a recompute GEMM unless linear in acc: the rotation's dacc is elementwise), tile gradients
        dacc = [(f"{epi.name}_bwd", "full")] if epi is gated_tiles else []
        kinds = [(e.name, e.pair_mode) for e in launched]
        assert kinds == [(epi.name, epi.pair_mode), *dacc, (f"{epi.name}_bwd_tiles", "half")]
        # only a TileMN operand needs a gradient: the tile launch alone (no dacc kernel)
        launched.clear()
        c = leaves[tiles[0]].detach().requires_grad_()
        y = coda.ops.linear(x.detach(), w.detach(), epilogue=epi,
                            **{k: (c if k == tiles[0] else v.detach()) for k, v in leaves.items()})
        y = y if isinstance(y, dict) else {"out": y}
        d = torch.autograd.grad(sum((y[k].double() * ups[k]).sum() for k in y), [c])[0]
        torch.testing.assert_close(d, got[2 + list(leaves).index(tiles[0])], rtol=1e-6, atol=1e-6)
        assert [e.name for e in launched] == [epi.name, f"{epi.name}_bwd_tiles"]
        monkeypatch.setattr(mod, "gemm_for", real)
        # 3. the saved-pre-activation branch (the same program as a K = 0 launch) gives what the recompute gives
        acc32 = (x.detach().float() @ w.detach().float().T).reshape(2 * M, N)
        bops = {k: (v.reshape(2 * M, -1) if k in tiles else v.reshape(2 * M) if v.dim() == 2 else v)
                for k, v in ops.items()}
        for k, u in ups.items():
            u = u.float()
            u = u.reshape(2 * M, -1) if u.dim() == 3 else u.reshape(2 * M) if u.dim() == 2 else u  # flat rows
            if epi.pair_mode == "full":
                bops[grad_name(k)], bops[grad_name(ODD_OUT)] = u[..., 0::2].contiguous(), u[..., 1::2].contiguous()
            else:
                bops[grad_name(k)] = u
        for red in epi.reductions:
            if red.op != "sum":
                bops[value_name(red.name)] = epi.reference(acc32, **{k: bops[k] for k in ops})[red.name]
        x2, w2 = x.detach().reshape(2 * M, 32), w.detach()
        which = (tuple(outs), tiles, True)  # the program tepi, as coda.ops.linear asks for it
        assert mod.backward_of(epi, *which).key() == tepi.key()
        preact = {"_preact_even": acc32[..., 0::2].contiguous(), "_preact_odd": acc32[..., 1::2].contiguous()}
        a_ = mod.evaluate(epi, which, x2, w2, bops, None, torch.float32)
        b_ = mod.evaluate(epi, which, x2, w2, bops, preact, torch.float32)
        assert set(a_) == set(b_) == {"out", *tepi.outputs}
        for k in a_:
            torch.testing.assert_close(a_[k], b_[k], rtol=1e-6, atol=1e-6)
        # 4. the derived epilogue compiles for sm_90a (fp32 gradient tiles, as coda.ops.linear launches it)
        row = compile_variant(GemmConfig(tile_m=128, tile_n=128, cluster_m=1, pingpong=False), tepi, out_dtype="fp32")
        assert row["wgmma"] > 0, row["error"]
    with pytest.raises(ValueError, match="save_preact"):  # (pairs epilogues do not save the pre-activation yet)
        coda.ops.linear(x, w, epilogue=rotate, save_preact=True, **ops)



def test_pairs_save_preact(monkeypatch):
    """save_preact=True for a half-mode pairs epilogue (TileMN, VecN and VecM operands, an extra output, sum /
    logsumexp / per-pair-column reductions): the forward epilogue carries the pre-activation as two extra M x N/2
    outputs (the pairs' even and odd accumulator values; compiled for sm_90a), the backward runs no recompute GEMM
    (spy on the GEMMs), and the gradients equal those of save_preact=False (exactly representable accumulators) and
    float64 autograd. A 2 -> 2 epilogue cannot carry extra outputs: a ValueError suggesting save_preact=False."""
    import sys

    from coda.autodiff import preact_keys, with_preact
    from coda.check import compile_variant
    from coda.config import GemmConfig
    from hook_epilogues import rotate

    mod = sys.modules["coda.ops.linear"]
    real = mod.gemm_for
    fwd = with_preact(gated_tiles)
    assert preact_keys(gated_tiles) == ("_preact_even", "_preact_odd")
    assert fwd.pair_mode == "half" and fwd.outputs == ("gate", "_preact_even", "_preact_odd")
    assert [r.name for r in fwd.reductions] == [r.name for r in gated_tiles.reductions]
    gen = torch.Generator().manual_seed(11)
    M, N, K = 6, 32, 32
    ops = {"p": torch.randn(2, M, N // 2, generator=gen), "q": torch.randn(2, M, N // 2, generator=gen),
           "s": torch.rand(N // 2, generator=gen) + 0.5, "r": torch.rand(2, M, generator=gen) + 0.5}
    # the forward's extra outputs are the pre-activation's even / odd columns
    x = torch.randn(2, M, K, generator=gen).bfloat16()
    w = (torch.randn(N, K, generator=gen) * 0.3).bfloat16()
    h = x[0].float() @ w.float().T  # (unbatched: a batched reduce_m needs a batched weight)
    got = coda.reference.gemm(x[0], w, epilogue=fwd, out_dtype=torch.float32,
                              **{k: v[0] if v.dim() > 1 else v for k, v in ops.items()})
    torch.testing.assert_close(got["_preact_even"], h[..., 0::2])
    torch.testing.assert_close(got["_preact_odd"], h[..., 1::2])
    launched = []

    def spy(*a, **k):
        gemm = real(*a, **k)
        return lambda *x_, **y: launched.append((y["epilogue"].name, x_[0].shape[-1])) or gemm(*x_, **y)
    monkeypatch.setattr(mod, "gemm_for", spy)

    def grads(x, w, save_preact):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        leaves = {k: v.clone().requires_grad_() for k, v in ops.items()}
        res = coda.ops.linear(x, w, epilogue=gated_tiles, save_preact=save_preact, **leaves)
        ups = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(5)).bfloat16().double()
               for k, v in res.items()}
        loss = sum((res[k].double() * ups[k]).sum() for k in res)
        return res, ups, torch.autograd.grad(loss, [x, w, *leaves.values()])

    # 1. exactly representable accumulators (small integers / 8ths: the bf16 pre-activation is exact): the saved
    # pre-activation gives the recompute's gradients
    xi = torch.randint(-2, 3, (2, M, K), generator=gen).bfloat16()
    wi = (torch.randint(-2, 3, (N, K), generator=gen) * 0.125).bfloat16()
    launched.clear()
    r0, _, g0 = grads(xi, wi, False)
    assert launched == [("gated_tiles", K), ("gated_tiles_bwd", K), ("gated_tiles_bwd_tiles", K)]  # 2 recomputes
    launched.clear()
    r1, _, g1 = grads(xi, wi, True)
    # the forward, then the backward programs on the saved pre-activation as K = 0 launches: no recompute GEMM
    assert launched == [("gated_tiles_preact", K), ("gated_tiles_bwd_on_preact", 0),
                        ("gated_tiles_bwd_tiles_on_preact", 0)]
    assert set(r0) == set(r1)
    for k in r0:
        torch.testing.assert_close(r1[k], r0[k], rtol=0, atol=0)
    for n, a_, b_ in zip(["x", "w", *ops], g1, g0):
        assert a_.shape == b_.shape, n
        torch.testing.assert_close(a_, b_, rtol=1e-6, atol=1e-6, msg=lambda m: f"{n}: {m}")
    # 2. random data vs float64 autograd (the saved pre-activation is rounded to bf16 like the outputs)
    launched.clear()
    res, ups, got = grads(x, w, True)
    assert [k for _, k in launched] == [K, 0, 0]
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    l64 = {k: v.double().requires_grad_() for k, v in ops.items()}
    outs = gated_tiles64(x64 @ w64.T, **l64)
    want = torch.autograd.grad(sum((outs[k] * ups[k]).sum() for k in outs), [x64, w64, *l64.values()])
    _, _, rec = grads(x, w, False)
    for n, a_, b_, c_ in zip(["x", "w", *ops], got, want, rec):
        assert a_.shape == b_.shape, n
        assert ((a_.double() - b_).norm() / b_.norm()).item() < 2e-2, n
        assert ((a_.double() - c_.double()).norm() / c_.double().norm()).item() < 2e-2, n
    monkeypatch.setattr(mod, "gemm_for", real)
    # 3. the forward with the two extra outputs compiles for sm_90a
    row = compile_variant(GemmConfig(tile_m=128, tile_n=128, cluster_m=1, pingpong=False), fwd)
    assert row["wgmma"] > 0, row["error"]
    # 4. 2 -> 2: no extra outputs in the kernel
    th = torch.rand(2, M, N // 2, generator=gen) * 6
    with pytest.raises(ValueError, match="2 -> 2 .*extra outputs.*save_preact=False"):
        coda.ops.linear(x, w, epilogue=rotate, save_preact=True, c=th.cos(), s=th.sin())
    with pytest.raises(ValueError, match="2 -> 2 .*extra outputs.*save_preact=False"):
        with_preact(rotate)

def _pair_tile_specs():
    """Generated pairs epilogues (half and 2 -> 2) with at least one TileMN operand."""
    return specs().filter(lambda s: s.get("pairs") is not None and "tile" in s["kinds"].values())


@settings(max_examples=int(os.environ.get("CODA_DSL_EXAMPLES", 200)),
          **{**SETTINGS, "suppress_health_check": SETTINGS["suppress_health_check"] + [HealthCheck.filter_too_much]})
@given(spec=_pair_tile_specs())
def test_generated_pair_tile_gradients_match_autograd(spec):
    """The sympy-derived TileMN gradients of generated pairs epilogues (pair_tile_grad_epilogue: one value per
    pair) vs float64 autograd, upstream gradients of every output and reduction."""
    from coda.autodiff import pair_tile_grad_epilogue, pair_tile_operands
    assume(all(op != "max" for (_, op, _) in spec["reds"].values()))  # (ties: see the test above)
    epi = make_epilogue(spec)
    g = torch.Generator().manual_seed(4)
    M, N = 5, 6
    acc = torch.randn(M, N, generator=g, dtype=torch.float64)
    ops = random_operands(spec, None, M, N, gen=g)
    tens = {k: (torch.tensor(v, dtype=torch.float64) if spec["kinds"][k] == "scalar" else v).requires_grad_()
            for k, v in ops.items()}
    outs = torch_eval(spec, acc, tens)
    ups = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in outs.items()}
    tiles = pair_tile_operands(epi, tuple(tens))
    assert tiles and set(tiles) == {k for k, kind in spec["kinds"].items() if kind == "tile"}
    want = torch.autograd.grad(sum((outs[k] * ups[k]).sum() for k in outs) + 0 * sum(t.sum() for t in tens.values()),
                               [tens[n] for n in tiles], allow_unused=True)
    tepi = pair_tile_grad_epilogue(epi, tuple(outs), tiles)
    assert tepi.pair_mode == "half"
    bops = dict(ops)
    for k, u in ups.items():
        if spec["pairs"] == "full":
            bops[grad_name(k)], bops[grad_name(ODD_OUT)] = u[..., 0::2], u[..., 1::2]
        else:
            bops[grad_name(k)] = u
    fwd = epi.reference(acc, **ops)
    for r in epi.reductions:
        if r.op != "sum":
            bops[value_name(r.name)] = fwd[r.name]
    got = tepi.reference(acc, **bops)
    for i, (n, w) in enumerate(zip(tiles, want)):
        d = got["out" if i == 0 else "d_" + n]
        assert d.shape == (M, N // 2)
        torch.testing.assert_close(d, torch.zeros_like(d) if w is None else w, rtol=1e-7, atol=1e-9,
                                   msg=lambda m: f"d_{n}: {m}")


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("CODA_DSL_COMPILE_EXAMPLES", 200)) // 8,
          **{**SETTINGS, "suppress_health_check": SETTINGS["suppress_health_check"] + [HealthCheck.filter_too_much]})
@given(spec=_pair_tile_specs())
def test_generated_pair_tile_gradients_compile_for_sm90(spec):
    """The TileMN-gradient epilogues of generated pairs epilogues build for sm_90a (fp32 gradient tiles)."""
    from coda.autodiff import pair_tile_grad_epilogue, pair_tile_operands
    from coda.check import compile_variant
    from coda.config import GemmConfig
    epi = make_epilogue(spec)
    grads = ("out", *epi.outputs, *(r.name for r in epi.reductions))
    tepi = pair_tile_grad_epilogue(epi, grads, pair_tile_operands(epi, tuple(spec["kinds"])))
    row = compile_variant(GemmConfig(tile_m=128, tile_n=128, cluster_m=1, pingpong=False), tepi, out_dtype="fp32")
    assert row["wgmma"] > 0, row["error"]


def test_backward_forms_each_adjoint_once():
    """Reverse mode (coda.autodiff._gradients): the gradients of several variables share their adjoints. The SwiGLU
    backward on the saved pre-activation (dg, du and the row scale's d_r, one program) needs 17 distinct products
    and sums -- the hand factorisation's count; differentiating per variable (forward mode) built 22."""
    import sympy as sp

    from coda.ops.mlp import dacc_on_da
    prog = dacc_on_da((("out",), ("r",), False))
    nodes = {n for e in prog._cse_out.values() for n in sp.preorder_traversal(e) if isinstance(n, (sp.Mul, sp.Add))}
    assert len(nodes) <= 17, len(nodes)
