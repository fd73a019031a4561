"""``coda.ops.rmsnorm_linear_rope_qknorm_qkv`` (issue 30: Qwen3's QK-norm inside the QKV GEMMs and the backward's
one pass): the op against Qwen3's math in float64 (forward and every gradient: x, the input norm's weight, W, both
head-norm weights), bf16 within 2x of torch's bf16 error, the custom ops' fakes (opcheck), the residual stream's
gradient, argument errors; the GPU test runs the kernels (test_..._on_gpu)."""
import pytest
import torch

from coda.epilogues.rope import permute_half_split, rope_freqs
from coda.ops import rmsnorm_linear_rope_qknorm_qkv
from coda.ops.attention_qknorm import pairs_order, supported

EPS, QK_EPS = 1e-6, 1e-5


def _qwen3(x, gamma, wq, wk, wv, qn, kn, pos, d, base=10000.0, biases=None):
    """Qwen3's attention inputs from x (rows): stock (half-split) weights, per-head RMSNorm, rotate_half RoPE; q and
    k returned in the adjacent-pairs order the op writes (``permute_half_split`` of the heads' columns). ``qn`` None:
    no head norms; ``biases`` (b_q, b_k, b_v): Qwen2's, added after the projections."""
    hn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * gamma
    q, k, v = (hn @ w.T for w in (wq, wk, wv))
    if biases is not None:
        q, k, v = (t + b for t, b in zip((q, k, v), biases))
    q, k = (t.unflatten(-1, (-1, d)) for t in (q, k))
    if qn is not None:
        q, k = ((t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + QK_EPS)) * n for t, n in ((q, qn), (k, kn)))
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    ang = pos.double().unsqueeze(-1) * inv.double().to(pos.device)
    cos, sin = (torch.cat((f, f), -1).unsqueeze(-2).to(x.dtype) for f in (ang.cos(), ang.sin()))
    q, k = (t * cos + torch.cat((-t[..., d // 2:], t[..., :d // 2]), -1) * sin for t in (q, k))
    return tuple(permute_half_split(t.flatten(-2).transpose(-1, -2), d).transpose(-1, -2) for t in (q, k)) + (v,)


def _inputs(M, H, d, hq, hk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g, dtype=torch.float64)
    gamma = torch.rand(H, generator=g, dtype=torch.float64) + 0.5
    ws = [torch.randn(n * d, H, generator=g, dtype=torch.float64) / H ** 0.5 for n in (hq, hk, hk)]
    qn, kn = (torch.rand(d, generator=g, dtype=torch.float64) + 0.5 for _ in range(2))
    ups = [torch.randn(M, n * d, generator=g, dtype=torch.float64) for n in (hq, hk, hk)]
    return [t.to(dtype) for t in (x, gamma, *ws, qn, kn)], ups


def _run(x, gamma, wq, wk, wv, qn, kn, ups, d, hq, hk, op: bool, residual=False):
    """(q, k, v, grads of x, gamma, W_q / W_k / W_v (stock order), q_norm, k_norm) of the op or the Qwen3 math."""
    leaves = [t.clone().requires_grad_() for t in (x, gamma, wq, wk, wv, qn, kn)]
    x_, g_, wq_, wk_, wv_, qn_, kn_ = leaves
    pos = torch.arange(x.shape[0], device=x.device) * 3
    if op:
        w = torch.cat((permute_half_split(wq_, d), permute_half_split(wk_, d), wv_))
        fr = rope_freqs(d, hq + 2 * hk, rotary_heads=hq + hk, device=x.device)
        out = rmsnorm_linear_rope_qknorm_qkv(x_, g_, w, qn_, kn_, pos, fr, EPS, QK_EPS, (hq * d, hk * d), d,
                                             residual=residual)
    else:
        out = _qwen3(x_, g_, wq_, wk_, wv_, qn_, kn_, pos, d)
    loss = sum((u.to(t.dtype) * t).sum() for u, t in zip(ups, out[:3]))
    if residual:
        loss = loss + (out[3] * x_.detach()).sum()  # the residual stream's gradient: x itself, joins dx
    grads = torch.autograd.grad(loss, leaves)
    return [t.detach() for t in out[:3]] + list(grads)


def float64_check(inputs, run, d, hq, hk):
    """The op against the model's math, both in float64: outputs and every gradient (this file's and
    tests/test_attention_bias.py's ``_inputs`` / ``_run``)."""
    args, ups = inputs(10, 32, d, hq, hk, torch.float64)
    got, want = (run(*args, ups, d, hq, hk, op) for op in (True, False))
    for i, (a, b) in enumerate(zip(got, want)):
        tol = 1e-6 if i == 4 else 1e-10  # (the input norm's weight: fp32 partials on the reference path, as before)
        assert ((a - b).norm() / b.norm()).item() <= tol, i


def twice_torch_check(inputs, run, M, H, d, hq, hk, device="cpu", floor=1e-3):
    """The op in bf16 within 2x (+ ``floor``) of the model's math in bf16, both against float64, every output and
    gradient finite."""
    args, ups = inputs(M, H, d, hq, hk, torch.float64, seed=M)
    ups = [u.to(device) for u in ups]
    ref = run(*(t.to(device) for t in args), ups, d, hq, hk, False)
    ours = run(*(t.to(device).bfloat16() for t in args), ups, d, hq, hk, True)
    torch_ = run(*(t.to(device).bfloat16() for t in args), ups, d, hq, hk, False)
    for i, (a, b, c) in enumerate(zip(ours, torch_, ref)):
        assert torch.isfinite(a).all(), i
        e = lambda t: ((t.double() - c).norm() / c.norm()).item()  # noqa: E731
        assert e(a) <= 2 * e(b) + floor, (i, e(a), e(b))


def residual_check(inputs, run):
    """With ``residual=True`` the gradient arriving on the returned x joins dx."""
    d, hq, hk = 16, 2, 1
    args, ups = inputs(6, 32, d, hq, hk, torch.float64, seed=2)
    plain, res = (run(*args, ups, d, hq, hk, True, residual=r) for r in (False, True))
    torch.testing.assert_close(res[3], plain[3] + args[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d,hq,hk", [(16, 4, 2), (8, 2, 1)])
def test_matches_qwen3_in_float64(d, hq, hk):
    float64_check(_inputs, _run, d, hq, hk)


def test_bfloat16_within_twice_torch():
    twice_torch_check(_inputs, _run, 40, 64, 16, 4, 2)


def test_residual_stream_gradient_joins_dx():
    residual_check(_inputs, _run)


def test_custom_ops_fakes():
    d, hq, hk = 16, 2, 1
    (x, gamma, wq, wk, wv, qn, kn), _ = _inputs(8, 32, d, hq, hk, torch.bfloat16, seed=3)
    w = torch.cat((permute_half_split(wq, d), permute_half_split(wk, d), wv))
    pos, fr = torch.arange(8).float(), rope_freqs(d, hq + 2 * hk, rotary_heads=hq + hk)
    args = (x, gamma.float(), w, qn, kn, pos, fr, EPS, QK_EPS, hq * d, hk * d, d, False)
    torch.library.opcheck(torch.ops.coda.rmsnorm_linear_rope_qknorm_qkv.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    q, k, v, _, r, xq, xk = torch.ops.coda.rmsnorm_linear_rope_qknorm_qkv(*args)
    bargs = (q, k, v, None, x, gamma.float(), w, qn, kn, r, xq, xk, v, pos, fr, QK_EPS, d, True)
    torch.library.opcheck(torch.ops.coda.rmsnorm_linear_rope_qknorm_qkv_backward.default, bargs,
                          test_utils=("test_schema", "test_faketensor"))


def test_arguments_and_pairs_order():
    d = 16
    (x, gamma, wq, wk, wv, qn, kn), _ = _inputs(4, 32, d, 2, 1, torch.bfloat16)
    w = torch.cat((wq, wk, wv))
    fr = rope_freqs(d, 4, rotary_heads=3)
    with pytest.raises(ValueError, match="whole heads"):
        rmsnorm_linear_rope_qknorm_qkv(x, gamma, w, qn, kn, torch.arange(4), fr, EPS, QK_EPS, (24, 8), d)
    with pytest.raises(ValueError, match="k_norm_weight"):
        rmsnorm_linear_rope_qknorm_qkv(x, gamma, w, qn, kn[:8], torch.arange(4), fr, EPS, QK_EPS, (32, 16), d)
    with pytest.raises(ValueError, match="head_dim"):
        rmsnorm_linear_rope_qknorm_qkv(x, gamma, w, qn, kn, torch.arange(4), fr, EPS, QK_EPS, (32, 16), 0)
    assert supported(96, 192, 96) and supported(128, 256, 128) is None and supported(64, 64, 64) is None
    v = torch.arange(8.0)
    assert pairs_order(v).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(permute_half_split(v.unsqueeze(1), 8).squeeze(1), pairs_order(v))


@pytest.mark.gpu
@pytest.mark.parametrize("M,H,d,hq,hk", [(1000, 520, 128, 4, 2), (4096, 2048, 128, 16, 8), (77, 256, 64, 4, 1)])
def test_on_gpu_within_twice_torch(M, H, d, hq, hk):
    """The kernels (the q / k GEMMs with the saved pre-norm values, the QK-norm backward pass, the fold-grads GEMMs)
    in bf16 against Qwen3's math in float64: outputs and every gradient within 2x of torch's bf16 error."""
    twice_torch_check(_inputs, _run, M, H, d, hq, hk, device="cuda", floor=2e-3)
