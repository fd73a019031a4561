"""coda.ops.linear_cross_entropy on the H100 (fused kernels) vs torch float64 (the 2x rule), chunked backward,
peak memory (no M x V tensor), and non-finite / huge logits."""
import gc
import math
import subprocess
import sys

import pytest
import torch

import coda.ops
from coda.ops import cross_entropy as ce_op
from cross_entropy_ref import rel, run, torch_loss

pytestmark = pytest.mark.gpu
DEV = "cuda"
lce = coda.ops.linear_cross_entropy


def _problem(M, V, H, seed=0, scale=3.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, H, generator=g, device=DEV).to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g, device=DEV) * (scale / math.sqrt(H))).to(torch.bfloat16)
    t = torch.randint(0, V, (M,), generator=g, device=DEV)
    t[1::17] = -100
    return x, w, t


@pytest.mark.parametrize("M,V,H,chunk", [(333, 1003, 256, 512), (1024, 4096, 512, None), (96, 32005, 128, 8192)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("smooth,zl", [(0.0, 0.0), (0.1, 1e-3)])
def test_matches_torch_2x_rule(M, V, H, chunk, reduction, smooth, zl):
    """Ragged M (dW falls back to torch.matmul for M % 8 != 0) and V (padded tail), several chunks."""
    x, w, t = _problem(M, V, H)
    kw = dict(reduction=reduction, label_smoothing=smooth, z_loss=zl)
    up = (torch.randn(M, device=DEV, dtype=torch.float64) if reduction == "none"
          else torch.tensor(1.0, device=DEV, dtype=torch.float64))
    ours = run(lce, x, w, t, up, chunk_size=chunk, **kw)
    want = run(torch_loss, x.double(), w.double(), t, up, **kw)
    theirs = run(torch_loss, x, w, t, up, **kw)
    for name, a, b, c in zip(("loss", "dx", "dw"), ours, want, theirs):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) <= 2 * rel(c, b) + 1e-4, (name, rel(a, b), rel(c, b))


def test_chunk_sizes_agree():
    x, w, t = _problem(520, 2048, 256)
    up = torch.tensor(1.0, device=DEV, dtype=torch.float64)
    a = run(lce, x, w, t, up, chunk_size=8)
    b = run(lce, x, w, t, up)
    assert torch.equal(a[0], b[0])  # the forward does not chunk
    for u, v in zip(a[1:], b[1:]):
        assert rel(u, v) < 5e-3


def test_peak_memory_no_logits():
    """fwd + bwd at M=4096, V=32768 allocates (besides dx and dW themselves) one backward chunk, the fp32 dX
    accumulator and small vectors / reduction partials; the logits (M x V bf16 = 256 MiB) never exist."""
    M, V, H = 4096, 32768, 1024
    x, w, t = _problem(M, V, H)
    x.requires_grad_()
    w.requires_grad_()
    lce(x, w, t).backward()  # compile the kernels, warm the allocator
    x.grad = w.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = lce(x, w, t)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    kept = torch.cuda.memory_allocated() - base  # x.grad, w.grad and the loss
    assert kept >= x.numel() * x.element_size() + w.numel() * w.element_size()
    chunk = ce_op._chunk_columns(M, 2, None) * M * 2
    assert chunk <= ce_op.CHUNK_BYTES
    extra = peak - kept
    small = 16 << 20  # partials of the forward's reductions (M x V/tile_n fp32 each), vectors, allocator rounding
    assert extra <= chunk + M * H * 4 + small, (extra / 2 ** 20, chunk / 2 ** 20)
    assert extra < M * V * 2 // 2


def test_huge_logits():
    """|logit| ~ 1e4: the epilogue's logsumexp is max-shifted; loss and gradients stay finite and accurate."""
    x, w, t = _problem(256, 1024, 128, scale=4000.0)
    assert (x.double() @ w.double().T).abs().max() > 5e3
    up = torch.tensor(1.0, device=DEV, dtype=torch.float64)
    ours = run(lce, x, w, t, up)
    want = run(torch_loss, x.double(), w.double(), t, up)
    theirs = run(torch_loss, x, w, t, up)
    for a, b, c in zip(ours, want, theirs):
        assert torch.isfinite(a).all()
        assert rel(a, b) <= 2 * rel(c, b) + 1e-4


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rows(bad):
    """A non-finite input row gives a non-finite loss on that row only (as torch: NaN or inf); an ignored
    non-finite row gives 0; every other row is unaffected."""
    x, w, t = _problem(64, 512, 128)
    t[:4] = torch.tensor([5, -100, 7, 9], device=DEV)
    x[0, 3] = bad
    x[1, 0] = bad
    ours = lce(x, w, t, reduction="none", label_smoothing=0.1)
    want = torch_loss(x.double(), w.double(), t, reduction="none", label_smoothing=0.1)
    assert not torch.isfinite(ours[0]) and not torch.isfinite(want[0])
    assert ours[1] == 0 and want[1] == 0
    assert torch.isfinite(ours[2:]).all()
    assert rel(ours[2:], want[2:]) < 1e-3


def test_async_target_check_never_syncs_and_asserts_on_the_device():
    """check_targets="async": valid targets give the sync check's loss and gradients with no synchronizing call
    (torch's sync debug mode raises on one); a bad target fails the CUDA context with a device-side assert (run in
    a child process: the context is lost), while True raises a ValueError first."""
    x, w, t = _problem(333, 1003, 256)
    up = torch.tensor(1.0, device=DEV, dtype=torch.float64)
    want = run(lce, x, w, t, up)
    x.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = lce(x, w, t, check_targets="async")
        with pytest.raises(RuntimeError, match="synchroniz"):  # the debug mode is armed: True syncs
            lce(x, w, t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loss.backward()
    torch.testing.assert_close(loss.detach(), want[0], rtol=0, atol=0)
    torch.testing.assert_close(x.grad, want[1], rtol=0, atol=0)
    child = ("import torch, coda.ops; x = torch.randn(64, 128, device='cuda', dtype=torch.bfloat16); "
             "w = torch.randn(512, 128, device='cuda', dtype=torch.bfloat16); t = torch.arange(64, device='cuda'); "
             "t[5] = 512; l = coda.ops.linear_cross_entropy(x, w, t, check_targets='async'); print(float(l))")
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "device-side assert" in r.stderr and "ValueError" not in r.stderr, r.stderr[-2000:]
