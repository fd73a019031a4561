"""The fast mode's exp-stored phases 1-2 (ops/cross_entropy_fast.py): phase 1 stores exp(z) instead of z and the
softmax gradient needs no pass over the M x V tensor. Which chunks take it (and which fall back to the stored
logits: huge logits, NaN), and its results against float64 torch by the 2x rule, on the CPU reference path."""
import math

import pytest
import torch

import coda.ops
from coda.ops import cross_entropy_fast as fast
from cross_entropy_ref import rel, run, torch_loss

lce = coda.ops.linear_cross_entropy


def _problem(M, V, H, dtype=torch.bfloat16, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H) * scale).to(dtype)
    t = torch.randint(0, V, (M,), generator=g)
    t[1] = -100
    return x, w, t


@pytest.fixture
def taken(monkeypatch):
    """The outcome of every chunk's exp-stored attempt: True (taken), False (fell back to the stored logits)."""
    got, real = [], fast._exp_phases
    monkeypatch.setattr(fast, "_exp_phases", lambda *a: got.append(real(*a)) or got[-1])
    return lambda: [r is not None for r in got]


@pytest.mark.parametrize("reduction,zl", [("mean", 0.0), ("sum", 1e-2), ("mean", 1e-3)])
@pytest.mark.parametrize("rows", [None, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_exp_stored_matches_torch_2x_rule(taken, reduction, zl, rows, seed):
    M, V, H = 40, 96, 16
    x, w, t = _problem(M, V, H, seed=seed)
    up = torch.tensor(1.5, dtype=torch.float64)
    kw = dict(reduction=reduction, z_loss=zl)
    budget = None if rows is None else rows * V * x.element_size()
    ours = run(lce, x, w, t, up, mode="fast", memory_budget=budget, **kw)
    assert taken() and all(taken()), taken()
    want = run(torch_loss, x.double(), w.double(), t, up, **kw)
    theirs = run(torch_loss, x, w, t, up, **kw)
    for name, a, b, c in zip(("loss", "dx", "dw"), ours, want, theirs):
        assert a.shape == b.shape, name
        assert rel(a, b) <= 2 * rel(c, b) + 1e-4, (name, rel(a, b), rel(c, b))


def test_exp_stored_not_taken_where_it_does_not_apply(taken, monkeypatch):
    x, w, t = _problem(16, 96, 16)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    lce(xs, ws, t, mode="fast", label_smoothing=0.1).backward()  # smoothing: every logit's term
    lce(xs, ws, t, mode="fast", softcap=5.0).backward()  # soft-capping: a per-logit derivative
    lce(xs, ws[:93], t.clamp(max=92), mode="fast").backward()  # V % 8: the tail columns
    monkeypatch.setenv(fast.EXP_ENV, "0")
    lce(xs, ws, t, mode="fast").backward()
    assert taken() == []
    xh = x.half().requires_grad_()  # fp16: exp(z) overflows at z = 11
    lce(xh, w.half(), t, mode="fast").backward()
    assert taken() == []


@pytest.mark.parametrize("factor", [40.0, 4000.0])
def test_huge_logits_fall_back_to_the_stored_logits(taken, factor):
    """Rows whose lse leaves [LSE_MIN, LSE_MAX] (exp(z) would overflow): the chunk reruns phase 1 with the stored
    logits; loss and gradients stay finite and within the 2x rule."""
    x, w, t = _problem(16, 64, 32, scale=factor)
    assert (x.double() @ w.double().T).logsumexp(-1).max() > fast.LSE_MAX
    up = torch.tensor(1.0, dtype=torch.float64)
    ours = run(lce, x, w, t, up, mode="fast")
    assert taken() == [False]
    want = run(torch_loss, x.double(), w.double(), t, up)
    theirs = run(torch_loss, x, w, t, up)
    for a, b, c in zip(ours, want, theirs):
        assert torch.isfinite(a).all() and rel(a, b) <= 2 * rel(c, b) + 1e-4


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rows_fall_back(taken, bad):
    """NaN / inf in a row: the chunk falls back, so the loss is non-finite on that row as torch's, 0 on an
    ignored one, and the other rows are unaffected."""
    x, w, t = _problem(16, 40, 16)
    x[0, 3] = x[1, 0] = bad
    ours = lce(x.requires_grad_(), w, t, reduction="none", mode="fast").detach()
    want = torch_loss(x.detach().double(), w.double(), t, reduction="none")
    theirs = torch_loss(x.detach(), w, t, reduction="none").double()
    assert taken() == [False]
    assert not torch.isfinite(ours[0]) and not torch.isfinite(want[0])
    assert ours[1] == 0 and want[1] == 0
    assert rel(ours[2:], want[2:]) <= 2 * rel(theirs[2:], want[2:]) + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("M,V,H", [(1000, 4104, 520), (4096, 32000, 2048)])
def test_exp_stored_on_the_gpu(taken, M, V, H):
    """The kernel path (Hopper): ragged M, V a multiple of 8 but not of the tile; loss, dx, dw vs float64 by the 2x
    rule; then logits beyond LSE_MAX fall back (the same call, one chunk)."""
    x, w, t = (a.cuda() for a in _problem(M, V, H, seed=M))
    up = torch.tensor(1.5, dtype=torch.float64, device="cuda")
    ours = run(lce, x, w, t, up, mode="fast")
    assert taken() == [True]
    want = run(torch_loss, x.double(), w.double(), t, up)
    theirs = run(torch_loss, x, w, t, up)
    for name, a, b, c in zip(("loss", "dx", "dw"), ours, want, theirs):
        assert torch.isfinite(a).all() and rel(a, b) <= 2 * rel(c, b) + 1e-4, (name, rel(a, b), rel(c, b))
    wb = (w.float() * 60).to(torch.bfloat16)
    ours = run(lce, x, wb, t, up, mode="fast")
    assert taken() == [True, False]
    want = run(torch_loss, x.double(), wb.double(), t, up)
    theirs = run(torch_loss, x, wb, t, up)
    for name, a, b, c in zip(("loss", "dx", "dw"), ours, want, theirs):
        assert torch.isfinite(a).all() and rel(a, b) <= 2 * rel(c, b) + 1e-4, (name, rel(a, b), rel(c, b))


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_deferred_dw_without_the_exp_phases_keeps_no_row_factors(monkeypatch, reduction):
    """Where the exp-stored phases cannot run (decided when the op is called: CUDA-graph capture, simulated here)
    a deferred dW's op returns no row factors (xs empty: no pass scales x's rows by ones in the backward), and the
    gradients are those of the stored-logits phases, within the 2x rule of float64 torch."""
    import coda.ops.cross_entropy as ce
    M, V, H = 40, 96, 16
    x, w, t = _problem(M, V, H, seed=3)
    seen, real = [], fast.forward_with_grads
    monkeypatch.setattr(ce, "forward_with_grads", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    monkeypatch.setattr(ce, "exp_taken", lambda *a: False)
    up = torch.full((M,), 1.5, dtype=torch.float64) if reduction == "none" else torch.tensor(1.5, dtype=torch.float64)
    if reduction == "mean":  # (a deferred dW with "mean": coda.optim's update in the backward; here the CPU path's
        monkeypatch.setattr(ce, "updates_in_backward", lambda w: True)  # stand-in: dW formed there, not updated)
    ours = run(lce, x, w, t, up, mode="fast", reduction=reduction)
    dz, xs = seen[0][4], seen[0][5]
    assert dz is not None and xs is None  # deferred, and no factors
    want = run(torch_loss, x.double(), w.double(), t, up, reduction=reduction)
    theirs = run(torch_loss, x, w, t, up, reduction=reduction)
    for name, a, b, c in zip(("loss", "dx", "dw"), ours, want, theirs):
        assert rel(a, b) <= 2 * rel(c, b) + 1e-4, (name, rel(a, b), rel(c, b))


def test_rows_scaled_by_the_kernel_only_in_an_eager_backward(monkeypatch):
    """The deferred dW's x rows: an eager backward on a GPU scales them by one K = 0 pass (no float32 copy of x);
    a backward that torch.compile traces (fake CUDA tensors, ``eager`` False) must not call a kernel on them but
    take torch's product (session 49: fused + compile failed when the traced backward called coda.gemm)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import coda.ops.cross_entropy_fast as ce
    calls = []
    monkeypatch.setattr(ce, "gemm_for", lambda *a: "gemm")
    monkeypatch.setattr(ce, "epilogue_pass", lambda gemm, a, *s, **k: calls.append(k["epilogue"]) or a)
    with FakeTensorMode():
        x = torch.empty(16, 32, device="cuda", dtype=torch.bfloat16)
        s = torch.empty(16, device="cuda")
        traced = ce.scale_rows(x, s, kernel=False)
        assert not calls and traced.dtype == torch.bfloat16 and tuple(traced.shape) == (16, 32)
        ce.scale_rows(x, s)
        assert calls == [ce._epi.scale_rows]
    x, s = torch.randn(5, 8).bfloat16(), torch.rand(5)  # CPU tensors: torch's float32 product, rounded once
    assert torch.equal(ce.scale_rows(x, s), (x.float() * s[:, None]).bfloat16())
