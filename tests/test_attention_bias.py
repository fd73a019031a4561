"""``coda.ops.rmsnorm_linear_rope_bias_qkv`` (issue 30: Qwen2's q/k/v biases inside the QKV GEMMs' epilogues and
the backward's one pass): the op against Qwen2's math in float64 (forward and every gradient: x, the input norm's
weight, W, the biases), bf16 within 2x of torch's bf16 error, the custom ops' fakes (opcheck), the residual
stream's gradient, the kernel's reference against autograd, argument errors; the GPU tests run the kernels."""
import re

import pytest
import torch

from coda.epilogues.rope import permute_half_split, rope_freqs
from coda.kernels import rope_grad as rg
from coda.ops import rmsnorm_linear_rope_bias_qkv
from test_attention_qknorm import EPS, _qwen3, float64_check, residual_check, twice_torch_check
from test_ce_grad import needs_cutlass, sm90a_ptx


def _inputs(M, H, d, hq, hk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g, dtype=torch.float64)
    gamma = torch.rand(H, generator=g, dtype=torch.float64) + 0.5
    ws = [torch.randn(n * d, H, generator=g, dtype=torch.float64) / H ** 0.5 for n in (hq, hk, hk)]
    bs = [torch.randn(n * d, generator=g, dtype=torch.float64) for n in (hq, hk, hk)]
    ups = [torch.randn(M, n * d, generator=g, dtype=torch.float64) for n in (hq, hk, hk)]
    return [t.to(dtype) for t in (x, gamma, *ws, *bs)], ups


def _run(x, gamma, wq, wk, wv, bq, bk, bv, ups, d, hq, hk, op: bool, residual=False):
    """(q, k, v, grads of x, gamma, W_q / W_k / W_v, b_q / b_k / b_v (stock order)) of the op or Qwen2's math."""
    leaves = [t.clone().requires_grad_() for t in (x, gamma, wq, wk, wv, bq, bk, bv)]
    x_, g_, wq_, wk_, wv_, bq_, bk_, bv_ = leaves
    pos = torch.arange(x.shape[0], device=x.device) * 3
    if op:
        perm = lambda t: permute_half_split(t.unsqueeze(-1), d).squeeze(-1) if t.dim() == 1 else \
            permute_half_split(t, d)  # noqa: E731
        w = torch.cat((perm(wq_), perm(wk_), wv_))
        b = torch.cat((perm(bq_), perm(bk_), bv_))
        fr = rope_freqs(d, hq + 2 * hk, rotary_heads=hq + hk, device=x.device)
        out = rmsnorm_linear_rope_bias_qkv(x_, g_, w, b, pos, fr, EPS, (hq * d, hk * d), residual=residual)
    else:
        out = _qwen3(x_, g_, wq_, wk_, wv_, None, None, pos, d, biases=(bq_, bk_, bv_))
    loss = sum((u.to(t.dtype) * t).sum() for u, t in zip(ups, out[:3]))
    if residual:
        loss = loss + (out[3] * x_.detach()).sum()  # the residual stream's gradient: x itself, joins dx
    grads = torch.autograd.grad(loss, leaves)
    return [t.detach() for t in out[:3]] + list(grads)


@pytest.mark.parametrize("d,hq,hk", [(16, 4, 2), (8, 2, 1)])
def test_matches_qwen2_in_float64(d, hq, hk):
    float64_check(_inputs, _run, d, hq, hk)


def test_bfloat16_within_twice_torch():
    twice_torch_check(_inputs, _run, 40, 64, 16, 4, 2)


def test_residual_stream_gradient_joins_dx():
    residual_check(_inputs, _run)


def test_bias_epilogue_derived_backward_matches_autograd():
    """``rope_rmsnorm_bias``'s algebra: its forward against the rotation of r acc + b, and its sympy-derived
    backward (dacc, the bias pairs' gradients) against float64 autograd of the same epilogue."""
    from coda.autodiff import backward_epilogue, grad_name
    from coda.dsl import ODD_OUT
    from coda.epilogues.rope import rope_rmsnorm_bias
    g = torch.Generator().manual_seed(6)
    M, N = 6, 32
    acc = torch.randn(M, N, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.rand(M, generator=g, dtype=torch.float64) + 0.5
    pos = torch.arange(M, dtype=torch.float64) * 3
    freq = rope_freqs(8, 4, rotary_heads=3).double()
    be, bo = (torch.randn(N // 2, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = rope_rmsnorm_bias.reference(acc, r=r, pos=pos, freq=freq, b_even=be, b_odd=bo)
    out = out["out"] if isinstance(out, dict) else out
    z = torch.stack((acc[:, 0::2] * r[:, None] + be, acc[:, 1::2] * r[:, None] + bo), -1)
    th = pos[:, None] * freq[None, :]
    want_y = torch.stack((z[..., 0] * th.cos() - z[..., 1] * th.sin(), z[..., 0] * th.sin() + z[..., 1] * th.cos()),
                         -1).flatten(1)
    torch.testing.assert_close(out, want_y, rtol=1e-12, atol=1e-12)
    up = torch.randn(out.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((out * up).sum(), (acc, be, bo))
    bwd = backward_epilogue(rope_rmsnorm_bias, ("out",), ("b_even", "b_odd"))
    got = bwd.reference(acc.detach(), r=r, pos=pos, freq=freq, b_even=be.detach(), b_odd=bo.detach(),
                        **{grad_name("out"): up[:, 0::2], grad_name(ODD_OUT): up[:, 1::2]})
    torch.testing.assert_close(got["out"], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got["d_b_even"], want[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got["d_b_odd"], want[2], rtol=1e-10, atol=1e-12)


def test_custom_ops_fakes():
    d, hq, hk = 16, 2, 1
    (x, gamma, wq, wk, wv, bq, bk, bv), _ = _inputs(8, 32, d, hq, hk, torch.bfloat16, seed=3)
    w, b = torch.cat((wq, wk, wv)), torch.cat((bq, bk, bv))
    pos, fr = torch.arange(8).float(), rope_freqs(d, hq + 2 * hk, rotary_heads=hq + hk)
    args = (x, gamma.float(), w, b, pos, fr, EPS, hq * d, hk * d, False)
    torch.library.opcheck(torch.ops.coda.rmsnorm_linear_rope_bias_qkv.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    q, k, v, _, r = torch.ops.coda.rmsnorm_linear_rope_bias_qkv(*args)
    bargs = (q, k, v, None, x, gamma.float(), w, b, r, q, k, v, pos, fr, True)
    torch.library.opcheck(torch.ops.coda.rmsnorm_linear_rope_bias_qkv_backward.default, bargs,
                          test_utils=("test_schema", "test_faketensor"))


def test_arguments():
    d = 16
    (x, gamma, wq, wk, wv, bq, bk, bv), _ = _inputs(4, 32, d, 2, 1, torch.bfloat16)
    w, b = torch.cat((wq, wk, wv)), torch.cat((bq, bk, bv))
    fr = rope_freqs(d, 4, rotary_heads=3)
    with pytest.raises(ValueError, match="bias must be"):
        rmsnorm_linear_rope_bias_qkv(x, gamma, w, b[:-2], torch.arange(4), fr, EPS, (32, 16))
    with pytest.raises(ValueError, match="widths"):
        rmsnorm_linear_rope_bias_qkv(x, gamma, w, b, torch.arange(4), fr, EPS, (36, 16))
    with pytest.raises(TypeError, match="residual"):
        rmsnorm_linear_rope_bias_qkv(x, gamma, w, b, torch.arange(4), fr, EPS, (32, 16), residual=1)
    g = [torch.randn(4, n) for n in (16, 8, 8)]
    with pytest.raises(ValueError, match="bias"):
        rg.rope_grad_bias(g, g, torch.zeros(4), torch.zeros(16), torch.ones(4), torch.zeros(30))


def test_rope_grad_bias_reference_matches_autograd():
    """The backward pass's reference (dacc, dr, db) against float64 autograd through y = RoPE(r acc + b)."""
    M, widths = 7, (16, 8, 8)
    g = torch.Generator().manual_seed(4)
    acc = torch.randn(M, sum(widths), generator=g, dtype=torch.float64, requires_grad=True)
    r = (torch.rand(M, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(sum(widths), generator=g, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(M).float() * 5
    fr = rope_freqs(8, 4, rotary_heads=3)
    th = rg._angles(pos, fr)
    z = acc * r[:, None] + b
    e, o = z[:, 0::2], z[:, 1::2]
    y = torch.stack((e * th.cos() - o * th.sin(), e * th.sin() + o * th.cos()), -1).flatten(1)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y * dy).sum().backward()
    parts = lambda t: list(t.detach().split(widths, 1))  # noqa: E731
    dacc, dr, db = rg.rope_grad_bias(parts(dy), parts(y), pos, fr, r.detach(), b.detach())
    torch.testing.assert_close(dacc, acc.grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dr, r.grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(db, b.grad, rtol=1e-9, atol=1e-9)


@needs_cutlass
def test_rope_grad_bias_builds_for_sm90():
    text, out = sm90a_ptx(rg.compile_kernel, torch.bfloat16, 0, True)
    # per part: 4 frequencies, 8 biases (two loads), then dy and y of each of the warp's 4 rows as 16-byte loads;
    # dacc of each row as a 16-byte store; the lanes' bias-gradient sums into shared memory as 16-byte stores
    assert len(re.findall(r"ld\.global[.a-z0-9]*\.v4", text)) == 3 * (3 + 2 * rg.BIAS_ROWS // rg.WARPS)
    assert len(re.findall(r"st\.global[.a-z0-9]*\.v4", text)) == 3 * rg.BIAS_ROWS // rg.WARPS
    assert len(re.findall(r"st\.shared[.a-z0-9]*\.v4", text)) == 6
    assert not re.findall(r"\b(?:ld|st)\.local", text)
    if out is not None:
        assert "0 bytes spill stores" in out


@needs_cutlass
def test_rope_grad_bias_launch_plan_matches_the_dsl_marshalling():
    """The bias variant's arguments (the plain variant's, then the biases and the partials) make a launch plan."""
    from coda import _launch
    M, widths = 64, (128, 32, 32)
    N = sum(widths)
    big, y = torch.randn(M, N).bfloat16(), torch.randn(M, N).bfloat16()
    views = [rg._as_rows(t) for t in (*big.split(widths, 1), *y.split(widths, 1))]
    views += [torch.zeros(M), torch.zeros(N // 2), torch.ones(M), rg._as_rows(torch.empty(M, N).bfloat16()),
              torch.empty(M), torch.zeros(N), torch.empty(M // rg.BIAS_ROWS, N)]
    args = rg._launcher_b.cute_args(views, 0)
    fn = rg.compile_kernel(torch.bfloat16, 0, True, fake=False, args=args)
    assert len(_launch.Plan(fn, args, views, 0).descs) == 13


@pytest.mark.gpu
@pytest.mark.parametrize("M,d,heads", [(1001, 128, (4, 2, 2)), (8192, 128, (14, 2, 2)), (13, 64, (2, 1, 1))])
def test_rope_grad_bias_kernel_matches_float64(M, d, heads):
    """The bias backward pass vs its float64 reference: dacc (NaN-poisoned), dr, the bias gradient (summed over
    rows: the CTA partials), ragged M, gradients as column blocks of one buffer, deterministic across runs."""
    g = torch.Generator(device="cuda").manual_seed(M)
    widths = tuple(n * d for n in heads)
    big = torch.randn(M, sum(widths), generator=g, device="cuda").to(torch.bfloat16)
    grads = list(big.split(widths, 1))
    ys = [(3 * torch.randn(M, n, generator=g, device="cuda")).to(torch.bfloat16) for n in widths]
    pos = torch.randint(0, 131072, (M,), generator=g, device="cuda").float()
    fr = rope_freqs(d, sum(heads), rotary_heads=heads[0] + heads[1], base=1e6, device="cuda")
    r = torch.rand(M, generator=g, device="cuda") + 0.05
    b = torch.randn(sum(widths), generator=g, device="cuda")
    dacc, dr, db = rg.rope_grad_bias(grads, ys, pos, fr, r, b)
    again = rg.rope_grad_bias(grads, ys, pos, fr, r, b)
    assert torch.equal(db, again[2]) and torch.equal(dr, again[1]) and torch.equal(dacc, again[0])
    want = rg.rope_grad_bias([t.double().cpu() for t in grads], [t.double().cpu() for t in ys], pos.cpu(),
                             fr.cpu(), r.double().cpu(), b.double().cpu())
    lowp = rg._bias_reference(grads, ys, pos, fr, r, b)  # torch in fp32 math, bf16 dacc: the 2x rule's baseline
    assert not dacc.isnan().any()
    for got, low, ref in zip((dacc, dr, db), lowp, want):
        e = lambda t: ((t.double().cpu() - ref).norm() / ref.norm()).item()  # noqa: E731
        assert e(got) <= 2 * e(low) + 1e-5, (e(got), e(low))


@pytest.mark.gpu
@pytest.mark.parametrize("M,H,d,hq,hk", [(1000, 520, 128, 4, 2), (4096, 1536, 128, 12, 2), (77, 256, 64, 4, 1)])
def test_on_gpu_within_twice_torch(M, H, d, hq, hk):
    """The kernels (the bias epilogue's three GEMMs, the bias backward pass, the fold-grads GEMMs) in bf16 against
    Qwen2's math in float64: outputs and every gradient within 2x of torch's bf16 error."""
    twice_torch_check(_inputs, _run, M, H, d, hq, hk, device="cuda", floor=2e-3)
