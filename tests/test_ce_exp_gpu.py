"""The fast cross entropy on stored exponentials (``CODA_CE_EXP=1``, ``coda.kernels.ce_exp``) on the H100 against
torch in float64 (the 2x rule): the path is taken (the softmax-gradient pass never runs), ragged M, ignored rows,
z-loss, huge logits, a non-finite row."""
import math

import pytest
import torch

import coda.ops
from coda.ops import cross_entropy_fast as fast
from cross_entropy_ref import rel, run, torch_loss

pytestmark = pytest.mark.gpu
DEV = "cuda"
lce = coda.ops.linear_cross_entropy


@pytest.fixture
def exp_on(monkeypatch):
    """CODA_CE_EXP=1; counts ``forward_exp`` calls; the softmax-gradient pass raises if it runs."""
    monkeypatch.setenv("CODA_CE_EXP", "1")
    calls = []
    orig = fast.forward_exp

    def counted(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    def no_pass(*a, **k):
        raise AssertionError("the softmax-gradient pass ran")
    monkeypatch.setattr(fast, "forward_exp", counted)
    monkeypatch.setattr(fast, "softmax_grad_", no_pass)
    return calls


def _problem(M, V, H, seed=0, scale=3.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, H, generator=g, device=DEV).to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g, device=DEV) * (scale / math.sqrt(H))).to(torch.bfloat16)
    t = torch.randint(0, V, (M,), generator=g, device=DEV)
    t[1::17] = -100
    return x, w, t


@pytest.mark.parametrize("M,V,H", [(1000, 4096, 264), (333, 4096, 256), (4096, 32768, 1024), (256, 320, 128)])
@pytest.mark.parametrize("zl,reduction", [(0.0, "mean"), (1e-3, "sum")])
def test_matches_torch_2x_rule(exp_on, M, V, H, zl, reduction):
    """Loss, dx, dW vs float64 within 2x torch bf16's error; M % 8 != 0 (dW on torch.matmul), M % 128 != 0 (the
    dz buffer's padded tile), a last 256-column tile of 64 columns (V = 320)."""
    x, w, t = _problem(M, V, H, seed=M + V)
    up = torch.tensor(0.37, device=DEV, dtype=torch.float64)
    kw = dict(reduction=reduction, z_loss=zl)
    ours = run(lce, x, w, t, up, mode="fast", **kw)
    assert exp_on, "the stored-exponential path was not taken"
    want = run(torch_loss, x.double(), w.double(), t, up, **kw)
    theirs = run(torch_loss, x, w, t, up, **kw)
    for name, a, b, c in zip(("loss", "dx", "dw"), ours, want, theirs):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) <= 2 * rel(c, b) + 1e-4, (name, rel(a, b), rel(c, b))


def test_huge_logits(exp_on):
    """|logit| ~ 1e4: each tile's exponentials are taken against its row maximum; finite and accurate."""
    x, w, t = _problem(256, 1024, 128, scale=4000.0)
    assert (x.double() @ w.double().T).abs().max() > 5e3
    up = torch.tensor(1.0, device=DEV, dtype=torch.float64)
    ours = run(lce, x, w, t, up, mode="fast")
    assert exp_on
    want = run(torch_loss, x.double(), w.double(), t, up)
    theirs = run(torch_loss, x, w, t, up)
    for a, b, c in zip(ours, want, theirs):
        assert torch.isfinite(a).all()
        assert rel(a, b) <= 2 * rel(c, b) + 1e-4


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_row(exp_on, bad):
    """A non-finite input row makes the mean loss and dW non-finite, as torch's do; the other rows' dx stay
    finite and match torch's."""
    x, w, t = _problem(128, 512, 128)
    t[0] = 5
    x[0, 3] = bad
    up = torch.tensor(1.0, device=DEV, dtype=torch.float64)
    loss, dx, dw = run(lce, x, w, t, up, mode="fast")
    assert exp_on
    wl, wdx, wdw = run(torch_loss, x.double(), w.double(), t, up)
    assert not torch.isfinite(loss) and not torch.isfinite(wl)
    assert not torch.isfinite(dw).all() and not torch.isfinite(wdw).all()
    assert torch.isfinite(dx[1:]).all() and rel(dx[1:], wdx[1:]) < 1e-2
