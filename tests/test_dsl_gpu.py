"""@coda.epilogue and coda.ops.linear fused on the H100 vs float64 (the 2x rule), ragged shapes, fwd and bwd."""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import coda
import coda.ops
from coda.config import GemmConfig
from coda.epilogues.gated import swiglu
from gen_epilogues import make_epilogue, random_operands, specs
from hook_epilogues import gated_tiles, gated_tiles64, rotate, rotate64

pytestmark = pytest.mark.gpu
DEV = "cuda"
CFGS = [GemmConfig(), GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1)]


def rel(x, ref, scale=1e-30):
    """||x - ref|| / max(||ref||, scale) over the elements where x and ref differ (equal infinities, NaN with NaN:
    no error)."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(ref).all():
        same = (x == ref) | (torch.isnan(x) & torch.isnan(ref))
        x, ref = torch.where(same, 0, x), torch.where(same, 0, ref)
    return ((x - ref).norm() / ref.norm().clamp_min(scale)).item()


@coda.epilogue
def bias_gelu(acc, bias: coda.VecN):
    return coda.gelu(acc + bias)


@coda.epilogue
def everything(acc, s: coda.Scalar, r: coda.VecM, res: coda.TileMN, bias: coda.VecN):
    y = coda.where(acc > 0, acc * s, coda.silu(acc)) + res + bias
    return {"out": y * r, "pre": coda.tanh(acc), "ss": coda.reduce_n(y * y), "mx": coda.reduce_n(y, "max"),
            "cs": coda.reduce_m(y), "lse": coda.reduce_n(y, "logsumexp")}


def _check_fused(epi, M, N, K, ops64, cfg=None, L=None, floor=1e-5):
    lead = (L,) if L else ()
    a = torch.randn(*lead, M, K, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(*lead, N, K, device=DEV, dtype=torch.bfloat16)
    acc64 = torch.matmul(a.double(), b.double().transpose(-1, -2))
    if callable(ops64):  # operands that depend on the accumulator (a backward's forward reduction values)
        ops64 = ops64(acc64.cpu())
    ops = {k: (v.to(DEV, torch.float32) if torch.is_tensor(v) else v) for k, v in ops64.items()}
    n_out = epi.out_cols(N)
    out = torch.full((*lead, M, n_out), float("nan"), device=DEV, dtype=torch.bfloat16) if epi.stores_out else None
    got = coda.gemm(a, b, epilogue=epi, out=out, config=cfg, **ops)
    got = got if isinstance(got, dict) else {"out": got}
    ref = epi.reference(acc64, **{k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in ops64.items()})
    # torch in the same dtype: a bf16 GEMM, then the math in fp32 (torch's opmath for bf16 tensors). Not fp64 math:
    # that is stricter than torch, e.g. sigmoid's derivative s (1 - s) cancels in fp32 where s rounds to 1, for
    # torch's own sigmoid_backward as for ours (session 19: a generated max-of-sigmoid backward, 0.1-0.9 relative
    # error in fp32 math, 0.02 with fp64 math on the same bf16 accumulator)
    accbf = torch.matmul(a, b.transpose(-1, -2)).float()
    theirs = epi.reference(accbf, **{k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in ops64.items()})
    for k in ref:
        if k == "out" or k in epi.outputs:
            theirs[k] = theirs[k].to(torch.bfloat16)
            assert not torch.isnan(got[k]).any() or torch.isnan(ref[k]).any(), f"{k}: unwritten (NaN) elements"
        # an output whose float64 value is (almost) exactly zero -- a generated backward's terms that cancel --
        # is measured against 1e-3 of the accumulator's RMS over as many elements (its rounding noise is that of
        # its terms, not of a zero result; session 25: ~1e-4-sized values against an exactly-zero reference)
        scale = 1e-3 * acc64.norm().item() * (ref[k].numel() / acc64.numel()) ** 0.5
        e_ours, e_theirs = rel(got[k], ref[k], scale), rel(theirs[k], ref[k], scale)
        assert e_ours <= 2 * e_theirs + floor, (k, e_ours, e_theirs)


@coda.epilogue(fastmath=True)
def fast_div_sqrt(acc, d: coda.VecN, s: coda.TileMN):
    return {"out": acc / d + coda.sqrt(s * s + acc * acc), "q": s / (acc * acc + 0.5)}


@coda.epilogue(fastmath=True)
def fast_special(acc, d: coda.VecN, s: coda.VecN):
    return {"out": acc / d, "root": coda.sqrt(s) * (acc * acc + 1.0)}


@pytest.mark.parametrize("cfg", CFGS + [GemmConfig(epi_wg=True)], ids=lambda c: c.name)
def test_fastmath_division_and_sqrt(cfg):
    """``fastmath=True`` (div.approx.ftz, sqrt.approx.ftz): within the 2x rule on a ragged shape (the consumer
    warps' epilogue, ping-pong, the epilogue warps), and division by 0 / inf / NaN and roots of negative / 0 / inf
    / NaN give torch's inf and NaN."""
    M, N, K = 333, 520, 264
    d = torch.rand(N, dtype=torch.float64) + 0.25
    _check_fused(fast_div_sqrt, M, N, K, {"d": d, "s": torch.randn(M, N, dtype=torch.float64)}, cfg=cfg)
    specials = torch.tensor([0.0, float("inf"), -float("inf"), float("nan"), 2.0, -1.0, 1e-30, 4.0],
                            dtype=torch.float64)
    d = torch.rand(N, dtype=torch.float64) + 0.25
    s = torch.rand(N, dtype=torch.float64)
    d[:8], s[:8] = specials, specials
    a = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    got = coda.gemm(a, b, epilogue=fast_special, out=out, config=cfg, d=d.to(DEV, torch.float32),
                    s=s.to(DEV, torch.float32))
    acc = torch.matmul(a.double(), b.double().t())
    ref = fast_special.reference(acc, d=d.to(DEV), s=s.to(DEV))
    for k in ("out", "root"):
        g, r = got[k].double(), ref[k].to(torch.bfloat16).double()
        assert torch.equal(torch.isnan(g), torch.isnan(r)), k
        assert torch.equal(torch.isposinf(g), torch.isposinf(r)), k
        assert torch.equal(torch.isneginf(g), torch.isneginf(r)), k
        fin = torch.isfinite(r)
        assert rel(g[fin], ref[k].double()[fin]) < 1e-2, k


@coda.epilogue(fastmath=True)
def fast_ratio(acc, d: coda.VecN, s: coda.TileMN):
    return acc / d + coda.sqrt(s * s + acc * acc)


def test_fastmath_derived_backward():
    """The backward programs ``coda.autodiff`` derives from a fastmath epilogue are fastmath too (session 38's
    5bd3996): ``coda.ops.linear`` forward and backward on a ragged shape, the gradients of x, w and the VecN / TileMN
    operands within the 2x rule vs float64."""
    M, N, K = 333, 264, 200
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.1).requires_grad_()
    d = (torch.rand(N, device=DEV) + 0.5).requires_grad_()
    s = torch.randn(M, N, device=DEV, requires_grad=True)
    leaves = [x, w, d, s]
    out = coda.ops.linear(x, w, epilogue=fast_ratio, d=d, s=s)
    up = torch.randn(M, N, device=DEV, dtype=torch.float64)
    ours = torch.autograd.grad((out.double() * up).sum(), leaves)

    def torch_model(dt):
        x_, w_, d_, s_ = [t.detach().to(dt).requires_grad_() for t in leaves]
        acc = x_ @ w_.T
        acc = acc.to(torch.float64) if dt == torch.float64 else acc.float()
        y = acc / d_ + torch.sqrt(s_ * s_ + acc * acc)
        return torch.autograd.grad((y.double() * up).sum(), (x_, w_, d_, s_))

    ref, theirs = torch_model(torch.float64), torch_model(torch.bfloat16)
    for name, o, r_, t in zip("x w d s".split(), ours, ref, theirs):
        assert torch.isfinite(o).all(), name
        e_o, e_t = rel(o, r_), rel(t, r_)
        assert e_o <= 2 * e_t + 1e-3, (name, e_o, e_t)


def reduction_operands(epi, fwd_ops: dict):
    """The operands that the backward of ``epi``'s max / logsumexp reductions reads, as a function of the float64
    accumulator (``_check_fused``'s callable operands), formed as ``coda.ops.linear`` forms them (ops/linear.py):
    ``value_<r>`` for logsumexp (the forward's result: exp(x - lse) <= 1 only with the real one; a random stand-in
    overflows for large x), ``tie_<r>`` for max (``coda.autodiff.tie_shares`` of the values the row's max compared,
    ``coda.autodiff.tie_epilogue``: M x N, or one value per pair, M x N/2, in a pairs epilogue)."""
    from coda.autodiff import tie_epilogue, tie_name, tie_shares, value_name
    lse = [r.name for r in epi.reductions if r.op == "logsumexp"]
    maxes = tuple(r.name for r in epi.reductions if r.op == "max")

    def make(acc64):
        ops = {}
        if lse:
            vals = epi.reference(acc64, **fwd_ops)
            ops.update({value_name(k): vals[k].reshape(-1) for k in lse})
        if maxes:
            res = tie_epilogue(epi, maxes).reference(acc64, **fwd_ops)
            ops.update({tie_name(k): tie_shares(res["out" if i == 0 else k]) for i, k in enumerate(maxes)})
        return ops
    return make


@coda.epilogue
def lse_and_target(acc, t: coda.VecM):
    """No main output: the logits are reduced in the epilogue and never stored (the LM-head forward)."""
    return {"lse": coda.reduce_n(acc, "logsumexp"), "tgt": coda.reduce_n(coda.where(coda.col() == t, acc, 0.0))}


@pytest.mark.parametrize("cfg", CFGS + [GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2)],
                         ids=lambda c: c.name)
def test_no_main_output(cfg):
    for (M, N, K), L in (((333, 1000, 264), None), ((1000, 2056, 512), None), ((200, 520, 128), 3)):
        lead = (L,) if L else ()
        t = torch.randint(0, N, (*lead, M), dtype=torch.float64)
        _check_fused(lse_and_target, M, N, K, {"t": t}, cfg=cfg, L=L)
    got = coda.gemm(torch.randn(64, 64, device=DEV, dtype=torch.bfloat16),
                    torch.randn(128, 64, device=DEV, dtype=torch.bfloat16), epilogue=lse_and_target,
                    t=torch.zeros(64, device=DEV))
    assert sorted(got) == ["lse", "tgt"]


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: c.name)
@pytest.mark.parametrize("shape", [(333, 520, 264), (1000, 776, 512)])
def test_library_epilogues_fused(cfg, shape):
    M, N, K = shape
    _check_fused(bias_gelu, M, N, K, {"bias": torch.randn(N, dtype=torch.float64)}, cfg)
    ops = dict(s=0.37, r=torch.rand(M, dtype=torch.float64) + 0.5, res=torch.randn(M, N, dtype=torch.float64),
               bias=torch.randn(N, dtype=torch.float64))
    _check_fused(everything, M, N, K, ops, cfg)


@settings(max_examples=int(os.environ.get("CODA_DSL_GPU_EXAMPLES", 40)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=specs())
def test_generated_epilogues_fused(spec):
    epi = make_epilogue(spec)
    M, N, K = 201, 144, 72  # N/2 = 72: a pairs epilogue's bf16 output rows stay 16-byte aligned
    g = torch.Generator().manual_seed(2)
    ops = random_operands(spec, None, M, N, gen=g)
    _check_fused(epi, M, N, K, ops, floor=2e-3)
    # the sympy-derived backward epilogue of the same program, fused, vs float64: upstream gradients of every
    # output and reduction, operand gradients (not of TileMN operands of a pairs epilogue: unsupported)
    from coda.autodiff import backward_epilogue, grad_name
    from coda.dsl import ODD_OUT
    pairs = spec.get("pairs")
    needs = tuple(k for k, kind in spec["kinds"].items() if not (pairs and kind == "tile"))
    keys = ["out", *epi.outputs, *(r.name for r in epi.reductions)]
    bwd = backward_epilogue(epi, tuple(keys), needs)
    bops = {k: (v.double() if torch.is_tensor(v) else v) for k, v in ops.items()}
    nc = epi.operand_cols(N)
    for k in ["out", *epi.outputs]:
        bops[grad_name(k)] = torch.randn(M, nc, generator=g, dtype=torch.float64)
    if pairs == "full":
        bops[grad_name(ODD_OUT)] = torch.randn(M, nc, generator=g, dtype=torch.float64)
    for r in epi.reductions:
        n = M if r.axis == "n" else nc
        bops[grad_name(r.name)] = torch.randn(n, generator=g, dtype=torch.float64)
    reds = reduction_operands(epi, {k: v for k, v in bops.items() if k in ops})
    _check_fused(bwd, M, N, K, lambda acc64: {**bops, **reds(acc64)}, floor=2e-3)


@pytest.mark.parametrize("save_preact", [False, True])
def test_linear_forward_backward(save_preact):
    M, N, K = 300, 264, 200
    x = torch.randn(3, M // 3, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.1).requires_grad_()
    s = torch.tensor(0.7, device=DEV, requires_grad=True)
    r = (torch.rand(3, M // 3, device=DEV) + 0.5).requires_grad_()
    res = torch.randn(3, M // 3, N, device=DEV, requires_grad=True)
    bias = torch.randn(N, device=DEV, requires_grad=True)
    leaves = [x, w, s, r, res, bias]
    out = coda.ops.linear(x, w, epilogue=everything, save_preact=save_preact, s=s, r=r, res=res, bias=bias)
    ups = {k: torch.randn(v.shape, device=DEV, dtype=torch.float64) for k, v in out.items()}
    ours = torch.autograd.grad(sum((out[k].double() * ups[k]).sum() for k in out), leaves)

    def torch_model(dt):
        ls = [t.detach().to(dt).requires_grad_() for t in leaves]
        x_, w_, s_, r_, res_, b_ = ls
        acc = x_ @ w_.T
        acc = acc.to(torch.float64) if dt == torch.float64 else acc.float()
        y = torch.where(acc > 0, acc * s_, torch.nn.functional.silu(acc)) + res_ + b_
        o = {"out": y * r_.unsqueeze(-1), "pre": torch.tanh(acc), "ss": (y * y).sum(-1), "mx": y.amax(-1),
             "cs": y.sum((0, 1)), "lse": torch.logsumexp(y, -1)}
        return torch.autograd.grad(sum((o[k].double() * ups[k]).sum() for k in o), ls)

    ref, theirs = torch_model(torch.float64), torch_model(torch.bfloat16)
    for name, o, r_, t in zip("x w s r res bias".split(), ours, ref, theirs):
        e_o, e_t = rel(o, r_), rel(t, r_)
        assert e_o <= 2 * e_t + 1e-3, (name, e_o, e_t)


PAIR_CFGS = CFGS + [GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2),
                    GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=2)]


@pytest.mark.parametrize("cfg", PAIR_CFGS, ids=lambda c: c.name)
def test_pairs_fused(cfg):
    """coda.pairs: one value per column pair (M x N/2 output) and a 2 -> 2 rotation (M x N), vs float64."""
    from coda.autodiff import backward_epilogue
    bwd = backward_epilogue(swiglu, ("out",), ())
    for (M, N, K), L in (((333, 528, 264), None), ((1000, 1040, 512), None), ((200, 272, 128), 2)):
        lead = (L,) if L else ()
        _check_fused(swiglu, M, N, K, {}, cfg=cfg, L=L)
        th = torch.rand(*lead, M, N // 2, dtype=torch.float64) * 6.3
        _check_fused(rotate, M, N, K, {"c": th.cos(), "s": th.sin()}, cfg=cfg, L=L)
        _check_fused(bwd, M, N, K, {"grad_out": torch.randn(*lead, M, N // 2, dtype=torch.float64)}, cfg=cfg, L=L)


def test_linear_swiglu_forward_backward():
    M, N, K = 384, 1040, 256
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.1).requires_grad_()
    up = torch.randn(M, N // 2, device=DEV, dtype=torch.float64)
    out = coda.ops.linear(x, w, epilogue=swiglu)
    assert out.shape == (M, N // 2)
    ours = torch.autograd.grad((out.double() * up).sum(), [x, w])

    def torch_model(dt):
        x_, w_ = (t.detach().to(dt).requires_grad_() for t in (x, w))
        h = (x_ @ w_.T).double()
        o = torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]
        return torch.autograd.grad((o * up).sum(), [x_, w_])

    ref, theirs = torch_model(torch.float64), torch_model(torch.bfloat16)
    for name, o, r_, t in zip("xw", ours, ref, theirs):
        assert rel(o, r_) <= 2 * rel(t, r_) + 1e-3, (name, rel(o, r_), rel(t, r_))


def test_linear_rotation_backward():
    """2 -> 2 pairs backward (upstream gradient split into even / odd per-pair tiles) vs float64 autograd."""
    M, N, K = 300, 528, 264
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.1).requires_grad_()
    th = torch.rand(M, N // 2, device=DEV) * 6.3
    up = torch.randn(M, N, device=DEV, dtype=torch.float64)
    ours = torch.autograd.grad((coda.ops.linear(x, w, epilogue=rotate, c=th.cos(), s=th.sin()).double() * up).sum(),
                               [x, w])

    def torch_model(dt):
        x_, w_ = (t.detach().to(dt).requires_grad_() for t in (x, w))
        h = (x_ @ w_.T).double()
        c, s = th.cos().double(), th.sin().double()
        z = torch.stack((h[:, 0::2] * c - h[:, 1::2] * s, h[:, 0::2] * s + h[:, 1::2] * c), -1).reshape(h.shape)
        return torch.autograd.grad((z * up).sum(), [x_, w_])

    ref, theirs = torch_model(torch.float64), torch_model(torch.bfloat16)
    for name, o, r_, t in zip("xw", ours, ref, theirs):
        assert rel(o, r_) <= 2 * rel(t, r_) + 1e-3, (name, rel(o, r_), rel(t, r_))


@pytest.mark.parametrize("cfg", PAIR_CFGS, ids=lambda c: c.name)
def test_pairs_reductions_fused(cfg):
    """Reductions in a pairs epilogue (per row: sum, max, logsumexp; per pair column: sum) next to the half-width
    output, with VecN (per pair) and VecM operands, vs float64; ragged and batched shapes."""
    from hook_epilogues import scaled_swiglu_stats as epi
    for (M, N, K), L in (((333, 528, 264), None), ((1000, 1040, 512), None), ((200, 272, 128), 2)):
        lead = (L,) if L else ()
        ops = {"s": torch.rand(N // 2, dtype=torch.float64) + 0.5, "r": torch.rand(*lead, M, dtype=torch.float64) + 0.5}
        _check_fused(epi, M, N, K, ops, cfg=cfg, L=L)


def test_linear_pairs_operand_gradients():
    """coda.ops.linear over a pairs epilogue with reductions: gradients of x, w and the VecN / VecM operands (the
    backward is a 2 -> 2 pairs epilogue with per-pair reduce_m / per-row reduce_n) vs float64 autograd."""
    from hook_epilogues import scaled_swiglu_stats as epi
    M, N, K = 384, 1040, 256
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.05).requires_grad_()
    s = (torch.rand(N // 2, device=DEV) + 0.5).requires_grad_()
    r = (torch.rand(M, device=DEV) + 0.5).requires_grad_()
    res = coda.ops.linear(x, w, epilogue=epi, s=s, r=r)
    ups = {k: torch.randn(v.shape, device=DEV, dtype=torch.float64) for k, v in res.items() if k != "mx"}
    ours = torch.autograd.grad(sum((res[k].double() * u).sum() for k, u in ups.items()), [x, w, s, r])

    def torch_model(dt):
        x_, w_ = (t.detach().to(dt).requires_grad_() for t in (x, w))
        s_, r_ = (t.detach().double().requires_grad_() for t in (s, r))
        h = (x_ @ w_.T).double()
        g, u = h[:, 0::2], h[:, 1::2]
        y = torch.nn.functional.silu(g) * u * s_ * r_.unsqueeze(-1)
        if dt != torch.float64:
            y = y.to(dt).double()
        outs = {"out": y, "ss": (y * y).sum(-1), "cs": (u * s_).sum(-2),
                "lse": torch.logsumexp(g * r_.unsqueeze(-1), -1)}
        return torch.autograd.grad(sum((outs[k] * u_).sum() for k, u_ in ups.items()), [x_, w_, s_, r_])

    ref, theirs = torch_model(torch.float64), torch_model(torch.bfloat16)
    for name, o, r_, t in zip("xwsr", ours, ref, theirs):
        assert rel(o, r_) <= 2 * rel(t, r_) + 1e-3, (name, rel(o, r_), rel(t, r_))


def _torch_grads(model, epi, x, w, leaves, ups, dt):
    """Gradients of x, w and the operands ``leaves`` of sum(out * ups) for the torch ``model`` of ``epi``: the
    GEMM in ``dt``, the epilogue math in float64, tile outputs rounded to ``dt`` (reductions stay fp32)."""
    x_, w_ = (t.detach().to(dt).requires_grad_() for t in (x, w))
    ls = {k: t.detach().double().requires_grad_() for k, t in leaves.items()}
    outs = model((x_ @ w_.T).double(), **ls)
    if dt != torch.float64:
        outs = {k: (v.to(dt).double() if k == "out" or k in epi.outputs else v) for k, v in outs.items()}
    return torch.autograd.grad(sum((outs[k] * u).sum() for k, u in ups.items()), [x_, w_, *ls.values()])


@pytest.mark.parametrize("mode", ["half", "full"])
def test_linear_pairs_tile_operand_gradients(mode):
    """coda.ops.linear over a pairs epilogue with TileMN operands (one value per pair, M x N/2): fused forward,
    fused backward (the 2 -> 2 dacc kernel, and a second, "half" pairs kernel for the TileMN gradients), gradients
    of x, w and every operand vs float64 autograd; ragged, batched shape."""
    L, Mb, N, K = 3, 111, 1040, 264  # M = 333; N/2 = 520 (16-byte rows in bf16)
    x = torch.randn(L, Mb, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.05).requires_grad_()
    if mode == "half":
        epi, model = gated_tiles, gated_tiles64
        leaves = {"p": torch.randn(L, Mb, N // 2, device=DEV), "q": torch.randn(L, Mb, N // 2, device=DEV),
                  "s": torch.rand(N // 2, device=DEV) + 0.5, "r": torch.rand(L, Mb, device=DEV) + 0.5}
    else:
        epi, model = rotate, rotate64
        th = torch.rand(L, Mb, N // 2, device=DEV) * 6.3
        leaves = {"c": th.cos(), "s": th.sin()}
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    res = coda.ops.linear(x, w, epilogue=epi, **leaves)
    res = res if isinstance(res, dict) else {"out": res}
    ups = {k: torch.randn(v.shape, device=DEV, dtype=torch.float64) for k, v in res.items()}
    ours = torch.autograd.grad(sum((res[k].double() * u).sum() for k, u in ups.items()), [x, w, *leaves.values()])
    ref, theirs = (_torch_grads(model, epi, x, w, leaves, ups, dt) for dt in (torch.float64, torch.bfloat16))
    for name, o, r_, t in zip(["x", "w", *leaves], ours, ref, theirs):
        assert o.shape == r_.shape, name
        assert rel(o, r_) <= 2 * rel(t, r_) + 1e-3, (name, rel(o, r_), rel(t, r_))


def test_linear_pairs_save_preact(monkeypatch):
    """save_preact=True over a half-mode pairs epilogue (TileMN, VecN, VecM operands, an extra output, reductions):
    the fused forward also stores the pre-activation as two M x N/2 extra outputs (the pairs' even / odd
    accumulator values), the backward runs no recompute GEMM (K = 0 launches on the saved pre-activation), and the
    gradients of x, w and every operand match float64 autograd (2x rule) and the recompute path; ragged, batched."""
    import sys
    mod = sys.modules["coda.ops.linear"]
    real = mod.gemm_for
    launched = []

    def spy(*a, **k):
        gemm = real(*a, **k)
        return lambda *x_, **y: launched.append((y["epilogue"].name, x_[0].shape[-1])) or gemm(*x_, **y)
    monkeypatch.setattr(mod, "gemm_for", spy)
    L, Mb, N, K = 3, 111, 1040, 264  # M = 333; N/2 = 520 (16-byte rows in bf16)
    x = torch.randn(L, Mb, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.05).requires_grad_()
    leaves = {"p": torch.randn(L, Mb, N // 2, device=DEV), "q": torch.randn(L, Mb, N // 2, device=DEV),
              "s": torch.rand(N // 2, device=DEV) + 0.5, "r": torch.rand(L, Mb, device=DEV) + 0.5}
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    ups = None
    got = {}
    for save_preact in (True, False):
        launched.clear()
        res = coda.ops.linear(x, w, epilogue=gated_tiles, save_preact=save_preact, **leaves)
        if ups is None:
            ups = {k: torch.randn(v.shape, device=DEV, dtype=torch.float64) for k, v in res.items()}
        got[save_preact] = torch.autograd.grad(sum((res[k].double() * u).sum() for k, u in ups.items()),
                                               [x, w, *leaves.values()])
        if save_preact:
            # the backward recomputes nothing: its programs read the saved pre-activation in K = 0 launches
            assert launched == [("gated_tiles_preact", K), ("gated_tiles_bwd_on_preact", 0),
                                ("gated_tiles_bwd_tiles_on_preact", 0)], launched
    monkeypatch.setattr(mod, "gemm_for", real)
    ref, theirs = (_torch_grads(gated_tiles64, gated_tiles, x, w, leaves, ups, dt)
                   for dt in (torch.float64, torch.bfloat16))
    for name, o, o_rec, r_, t in zip(["x", "w", *leaves], got[True], got[False], ref, theirs):
        assert o.shape == r_.shape, name
        assert rel(o, r_) <= 2 * rel(t, r_) + 1e-3, (name, rel(o, r_), rel(t, r_))
        assert rel(o, o_rec.double()) <= 2 * rel(t, r_) + 1e-3, (name, rel(o, o_rec.double()), rel(t, r_))

@settings(max_examples=int(os.environ.get("CODA_DSL_GPU_EXAMPLES", 40)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.filter_too_much])
@given(spec=specs().filter(lambda s: s.get("pairs") is not None and "tile" in s["kinds"].values()))
def test_generated_pair_tile_gradients_fused(spec):
    """The TileMN-gradient epilogue (coda.autodiff.pair_tile_grad_epilogue: "half" pairs, one value per pair) of
    generated pairs epilogues, fused, vs float64: upstream gradients of every output and reduction."""
    from coda.autodiff import grad_name, pair_tile_grad_epilogue, pair_tile_operands
    from coda.dsl import ODD_OUT
    epi = make_epilogue(spec)
    M, N, K = 201, 144, 72  # N/2 = 72: bf16 rows of the per-pair tiles stay 16-byte aligned
    g = torch.Generator().manual_seed(5)
    ops = random_operands(spec, None, M, N, gen=g)
    keys = ["out", *epi.outputs, *(r.name for r in epi.reductions)]
    tepi = pair_tile_grad_epilogue(epi, tuple(keys), pair_tile_operands(epi, tuple(spec["kinds"])))
    bops = dict(ops)
    for k in ["out", *epi.outputs] + ([ODD_OUT] if spec["pairs"] == "full" else []):
        bops[grad_name(k)] = torch.randn(M, N // 2, generator=g, dtype=torch.float64)
    for r in epi.reductions:
        n = M if r.axis == "n" else N // 2
        bops[grad_name(r.name)] = torch.randn(n, generator=g, dtype=torch.float64)
    reds = reduction_operands(epi, dict(ops))  # value_<r> (logsumexp), tie_<r> (max) from the accumulator
    _check_fused(tepi, M, N, K, lambda acc64: {**bops, **reds(acc64)}, floor=2e-3)


@coda.epilogue
def _residual(acc, res: coda.TileMN):
    return acc + res


@pytest.mark.parametrize("cfg", CFGS + [GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=1)],
                         ids=lambda c: c.name)
def test_tile_operand_tma_and_element_paths(cfg):
    """TileMN operands: TMA-loaded ring (aligned bf16 / fp32, batched, add-to-output where the operand is out)
    and the element-wise path (a view whose row stride is not 16-byte aligned), vs float64."""
    from coda.gemm import tma_aligned
    M, N, K, L = 333, 200, 264, 2
    a = torch.randn(L, M, K, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(L, N, K, device=DEV, dtype=torch.bfloat16)
    acc = torch.matmul(a.double(), b.double().transpose(-1, -2))
    big = torch.randn(L, M, N + 4, device=DEV, dtype=torch.bfloat16)
    cases = {"bf16": torch.randn(L, M, N, device=DEV, dtype=torch.bfloat16),
             "fp32": torch.randn(L, M, N, device=DEV, dtype=torch.float32),
             "unaligned": big[..., :N]}  # rows of 204 bf16 = 408 bytes: not a multiple of 16
    assert tma_aligned(cases["bf16"]) and not tma_aligned(cases["unaligned"])
    for name, res in cases.items():
        out = torch.full((L, M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        coda.gemm(a, b, epilogue=_residual, out=out, config=cfg, res=res)
        ref = acc + res.double()
        theirs = (torch.matmul(a, b.transpose(-1, -2)).double() + res.double()).to(torch.bfloat16)
        assert not torch.isnan(out).any(), name
        assert rel(out, ref) <= 2 * rel(theirs, ref) + 1e-5, (name, rel(out, ref), rel(theirs, ref))
    out = torch.randn(L, M, N, device=DEV, dtype=torch.bfloat16)  # add-to-output: out += a @ b.T (TMA path)
    ref = acc + out.double()
    theirs = (torch.matmul(a, b.transpose(-1, -2)).double() + out.double()).to(torch.bfloat16)
    coda.gemm(a, b, epilogue=_residual, out=out, config=cfg, res=out)
    assert rel(out, ref) <= 2 * rel(theirs, ref) + 1e-5


@pytest.mark.parametrize("save_preact", [False, True])
def test_linear_custom_op_opcheck_and_compile_fullgraph_on_the_gpu(save_preact):
    """coda::linear's fake implementation gives the fused kernel's result shapes, dtypes and strides (opcheck on
    CUDA tensors), and torch.compile(fullgraph=True) runs the kernels with outputs and gradients bitwise equal to
    eager (ragged 264 x 200 x 136)."""
    x = torch.randn(264, 136, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(200, 136, device=DEV, dtype=torch.bfloat16) / 12).requires_grad_()
    bias = torch.randn(200, device=DEV, requires_grad=True)
    torch.library.opcheck(torch.ops.coda.linear.default, (x, w, bias_gelu.op_name, save_preact, "bias", [bias], "", []))

    def f(x, w, bias):
        return coda.ops.linear(x, w, epilogue=bias_gelu, save_preact=save_preact, bias=bias).float().square().sum()

    results = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        ls = [t.detach().clone().requires_grad_() for t in (x, w, bias)]
        loss = fn(*ls)
        results.append([loss.detach(), *torch.autograd.grad(loss, ls)])
    for a, b in zip(*results):
        assert torch.equal(a, b)
