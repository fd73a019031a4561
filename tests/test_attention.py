"""CPU (CI): ``coda.ops.rmsnorm_linear_rope`` and ``coda.nn_attention.FusedAttention`` on the reference path."""
import copy
import os
import sys

import pytest
import torch

from coda.epilogues.rope import rope_freqs
from coda.nn import DeferredRMSNorm
from coda.nn_attention import FusedAttention, attention_fusable, find_inv_freq
from coda.kernels.rope_grad import rope_grad_reference
from coda.ops import rmsnorm_linear_rope, rmsnorm_linear_rope_qkv

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from llama_model import LlamaConfig, LlamaForCausalLM  # noqa: E402


def _ref(x, g, w, pos, fr, eps=1e-6):
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    z = (x * r * g) @ w.T
    th = pos.double()[:, None] * fr.double()[None]
    a, b = z[:, 0::2], z[:, 1::2]
    out = torch.empty_like(z)
    out[:, 0::2], out[:, 1::2] = a * th.cos() - b * th.sin(), a * th.sin() + b * th.cos()
    return out


@pytest.mark.parametrize("M,K,d,nh,nkv", [(40, 64, 16, 4, 2), (13, 32, 8, 2, 1)])
def test_op_matches_float64(M, K, d, nh, nkv):
    """Forward and every gradient (x, gamma, W) against float64 autograd of the unfused formula (float32 run)."""
    g = torch.Generator().manual_seed(M)
    N = (nh + 2 * nkv) * d
    x, gam = torch.randn(M, K, generator=g, dtype=torch.float64), torch.randn(K, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) / 8
    pos, fr = torch.randint(0, 5000, (M,), generator=g), rope_freqs(d, nh + 2 * nkv, rotary_heads=nh + nkv)
    up = torch.randn(M, N, generator=g, dtype=torch.float64)
    xs, gs, ws = (t.clone().requires_grad_() for t in (x, gam, w))
    want = _ref(xs, gs, ws, pos, fr)
    (want * up).sum().backward()
    xa, ga, wa = (t.float().requires_grad_() for t in (x, gam, w))
    y = rmsnorm_linear_rope(xa, ga, wa, pos, fr)
    (y * up.float()).sum().backward()
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(y, want) < 1e-5
    for a, b in ((xa, xs), (ga, gs), (wa, ws)):
        assert rel(a.grad, b.grad) < 1e-5


@pytest.mark.parametrize("M,K,d,nh,nkv", [(40, 64, 16, 4, 2), (13, 32, 8, 2, 1)])
@pytest.mark.parametrize("parts", ["qkv", "qk", "v"])
def test_qkv_op_matches_float64(M, K, d, nh, nkv, parts):
    """rmsnorm_linear_rope_qkv: q, k, v equal the column blocks of the float64 formula, and the gradients (x, gamma,
    W) from any subset of the three parts' gradients (the others None) equal float64 autograd's."""
    g = torch.Generator().manual_seed(M + len(parts))
    N = (nh + 2 * nkv) * d
    x, gam = torch.randn(M, K, generator=g, dtype=torch.float64), torch.randn(K, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) / 8
    pos, fr = torch.randint(0, 5000, (M,), generator=g), rope_freqs(d, nh + 2 * nkv, rotary_heads=nh + nkv)
    up = torch.randn(M, N, generator=g, dtype=torch.float64)
    widths = [nh * d, nkv * d, nkv * d]
    keep = torch.cat([torch.full((n,), float(c in parts), dtype=torch.float64) for c, n in zip("qkv", widths)])
    xs, gs, ws = (t.clone().requires_grad_() for t in (x, gam, w))
    want = _ref(xs, gs, ws, pos, fr)
    (want * up * keep).sum().backward()
    xa, ga, wa = (t.float().requires_grad_() for t in (x, gam, w))
    q, k, v = rmsnorm_linear_rope_qkv(xa, ga, wa, pos, fr, 1e-6, widths[:2])
    assert [t.shape[1] for t in (q, k, v)] == widths
    loss = sum((t * u.float()).sum() for c, t, u in zip("qkv", (q, k, v), up.split(widths, 1)) if c in parts)
    loss.backward()
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(torch.cat((q, k, v), 1).detach(), want.detach()) < 1e-5
    for a, b in ((xa, xs), (ga, gs), (wa, ws)):
        assert rel(a.grad, b.grad) < 1e-5


def test_rope_grad_reference_is_the_unrotation_and_row_dot():
    """rope_grad's reference: dacc = r R(-theta) [dq | dk | dv] per pair, dr = rowsum(dy * y) / r, in float64."""
    g = torch.Generator().manual_seed(3)
    M, widths = 9, (16, 8, 8)
    grads = [torch.randn(M, n, generator=g, dtype=torch.float64) for n in widths]
    ys = [torch.randn(M, n, generator=g, dtype=torch.float64) for n in widths]
    pos, fr = torch.arange(M, dtype=torch.float32) * 1000, rope_freqs(8, 4, rotary_heads=3)
    r = torch.rand(M, generator=g, dtype=torch.float64) + 0.5
    dacc, dr = rope_grad_reference(grads, ys, pos, fr, r)
    dy, y = torch.cat(grads, 1), torch.cat(ys, 1)
    th = pos.double()[:, None] * fr.double()[None]
    e, o = dy[:, 0::2], dy[:, 1::2]
    assert torch.allclose(dacc[:, 0::2], r[:, None] * (e * th.cos() + o * th.sin()), atol=1e-9)
    assert torch.allclose(dacc[:, 1::2], r[:, None] * (o * th.cos() - e * th.sin()), atol=1e-9)
    assert torch.allclose(dacc[:, 24:], dy[:, 24:] * r[:, None])  # v: frequency 0, unrotated
    assert torch.allclose(dr, (dy * y).sum(1) / r)


def test_op_rejects_bad_arguments():
    x, w = torch.randn(4, 16), torch.randn(24, 16)
    fr = rope_freqs(8, 3)
    with pytest.raises(ValueError, match="freqs"):
        rmsnorm_linear_rope(x, torch.ones(16), w, torch.arange(4), fr[:-1])
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_linear_rope(x, torch.ones(16), torch.randn(24, 8), torch.arange(4), fr)
    with pytest.raises(ValueError, match="widths"):
        rmsnorm_linear_rope_qkv(x, torch.ones(16), w, torch.arange(4), fr, 1e-6, (12, 8))
    with pytest.raises(ValueError, match="widths"):
        rmsnorm_linear_rope_qkv(x, torch.ones(16), w, torch.arange(4), fr, 1e-6, (16, 16))


def _fused_copy(model):
    m = copy.deepcopy(model)
    inv = find_inv_freq(m)
    for layer in m.model.layers:
        d = DeferredRMSNorm.from_norm(layer.input_layernorm)
        layer.self_attn, layer.input_layernorm = FusedAttention.from_stock(layer.self_attn, inv, d), d
    return m


def test_module_matches_stock_model_float64():
    """The examples/ Llama with every attention block fused: loss, every gradient and the state dict (keys, order,
    values) equal the stock model's in float64 (to the stock model's own fp32 RoPE angles, ~1e-7)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    stock = LlamaForCausalLM(cfg).double()
    fused = _fused_copy(stock)
    ids = torch.randint(0, 256, (2, 16))
    a, b = stock(ids, labels=ids), fused(ids, labels=ids)
    a.backward()
    b.backward()
    assert abs(a.item() - b.item()) < 1e-6
    theirs = dict(stock.named_parameters())
    for n, p in fused.named_parameters():
        if n in theirs:
            assert ((p.grad - theirs[n].grad).norm() / theirs[n].grad.norm()).item() < 1e-5, n
    sa, sb = stock.state_dict(), fused.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    fresh = _fused_copy(LlamaForCausalLM(cfg).double())
    fresh.load_state_dict(sa)
    assert fresh(ids, labels=ids).item() == pytest.approx(b.item(), abs=1e-12)


def test_fusable_rules():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    attn = LlamaForCausalLM(cfg).model.layers[0].self_attn
    assert attention_fusable(attn) is None
    attn.q_proj = torch.nn.Linear(64, 64, bias=True)
    assert "biases" in attention_fusable(attn)


def test_under_compile_the_block_leaves_norm_qkv_rope_to_inductor_when_asked(monkeypatch):
    """Documented behaviour (FusedAttention.inductor_under_compile, off by default): with it on, while torch.compile
    traces, the block runs the stock math on its own weights (same result), not the fused op; outside compile, and
    under compile with it off, the fused op runs."""
    import coda.nn
    assert FusedAttention.inductor_under_compile is ("attention" in coda.nn.INDUCTOR_UNDER_COMPILE)
    import coda.ops
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = _fused_copy(LlamaForCausalLM(cfg).to(torch.bfloat16))
    attn = model.model.layers[0].self_attn
    calls = []
    real = coda.ops.rmsnorm_linear_rope_qkv
    monkeypatch.setattr(coda.ops, "rmsnorm_linear_rope_qkv", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    fused = attn(x, None, None)
    assert calls == [1]
    monkeypatch.setattr(__import__("coda.nn").nn, "compiling", lambda: True)
    monkeypatch.setattr(type(attn), "inductor_under_compile", True)
    stock_math = attn(x, None, None)
    assert calls == [1]
    assert ((fused.float() - stock_math.float()).norm() / fused.float().norm()).item() < 2e-2
    monkeypatch.setattr(type(attn), "inductor_under_compile", False)
    attn(x, None, None)
    assert calls == [1, 1]


def test_qkv_takes_the_producers_sumsq():
    """rmsnorm_linear_rope_qkv(sumsq=...): r from the given rows' sums of squares where gamma is folded into the
    weight (M > N): the same q, k, v as without (up to the sum's rounding), four times the sums give half the
    outputs (r = 1/2 r, eps ~0), the gradients are those of the call without (the backward differentiates r through
    x); argument errors."""
    g = torch.Generator().manual_seed(3)
    M, K, d, nh, nkv = 64, 32, 8, 2, 1
    N = (nh + 2 * nkv) * d  # 32 < M: the folded-weight branch
    x = torch.randn(M, K, generator=g)
    gam, w = 1 + 0.1 * torch.randn(K, generator=g), torch.randn(N, K, generator=g) / 8
    pos, fr = torch.arange(M), rope_freqs(d, nh + 2 * nkv, rotary_heads=nh + nkv)
    ss = x.double().pow(2).sum(-1).float()
    up = torch.randn(M, N, generator=g)
    outs, grads = [], []
    for s in (None, ss):
        xa = x.clone().requires_grad_()
        q, k, v = rmsnorm_linear_rope_qkv(xa, gam, w, pos, fr, 1e-30, (nh * d, nkv * d), sumsq=s)
        y = torch.cat((q, k, v), 1)
        (y * up).sum().backward()
        outs.append(y.detach())
        grads.append(xa.grad)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    q4, k4, v4 = rmsnorm_linear_rope_qkv(x, gam, w, pos, fr, 1e-30, (nh * d, nkv * d), sumsq=4 * ss)
    torch.testing.assert_close(torch.cat((q4, k4, v4), 1), outs[0] / 2, rtol=1e-5, atol=1e-6)
    x3 = x.reshape(2, 32, K)
    q3, _, _ = rmsnorm_linear_rope_qkv(x3, gam, w, pos.reshape(2, 32), fr, 1e-30, (nh * d, nkv * d),
                                       sumsq=ss.reshape(2, 32))
    torch.testing.assert_close(q3.reshape(M, -1), outs[1][:, :nh * d])
    with pytest.raises(TypeError, match="sumsq"):
        rmsnorm_linear_rope_qkv(x, gam, w, pos, fr, 1e-30, (nh * d, nkv * d), sumsq=ss.double())
    with pytest.raises(ValueError, match="sumsq"):
        rmsnorm_linear_rope_qkv(x, gam, w, pos, fr, 1e-30, (nh * d, nkv * d), sumsq=ss[:10])


def test_linear_residual_with_the_next_norm_weight():
    """linear_residual(norm_weight=g): y as without, y * g rounded once (what scale_sumsq writes) and y's rows' sums
    of squares, from one epilogue; the gradients of o, W, res as without, none for g; opcheck; argument errors."""
    from coda.ops import linear_residual
    g0 = torch.Generator().manual_seed(7)
    o, w, res = (torch.randn(*s, generator=g0).bfloat16() for s in ((2, 24, 32), (48, 32), (2, 24, 48)))
    gam = (1 + 0.1 * torch.randn(48, generator=g0)).requires_grad_()
    dy = torch.randn(2, 24, 48, generator=g0).bfloat16()
    outs = []
    for kw in ({}, {"norm_weight": gam}):
        leaves = [t.clone().requires_grad_() for t in (o, w, res)]
        out = linear_residual(*leaves, **kw)
        y = out[0] if kw else out
        y.backward(dy)
        outs.append((y.detach(), *(t.grad for t in leaves)))
        if kw:
            _, hg, ss = out
            assert torch.equal(hg, (y.detach().float() * gam.detach()).bfloat16())
            ref = y.detach().double().pow(2).sum(-1)
            assert ss.shape == (2, 24) and ((ss.double() - ref).abs().max() / ref.max()).item() < 1e-6
    assert all(torch.equal(a, b) for a, b in zip(*outs)) and gam.grad is None
    torch.library.opcheck(torch.ops.coda.linear_residual_norm.default, (o[0], w, res[0], gam.detach()))
    with pytest.raises(ValueError, match="norm_weight"):
        linear_residual(o, w, res, norm_weight=torch.ones(47))


@pytest.mark.parametrize("inductor", [False, True])
def test_grouped_query_heads_under_compile(monkeypatch, inductor):
    """Under torch.compile the fused block hands SDPA the grouped k, v heads as they are (enable_gqa, as in eager);
    left to inductor (``inductor_under_compile``) it repeats them, as the stock model does (inductor writes them
    from its RoPE kernel)."""
    import coda.nn
    import coda.nn_attention as na
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    attn = _fused_copy(LlamaForCausalLM(cfg).to(torch.bfloat16)).model.layers[0].self_attn
    seen, real = [], na.F.scaled_dot_product_attention
    monkeypatch.setattr(na.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((k.shape[1], kw["enable_gqa"])) or real(q, k, v, **kw))
    monkeypatch.setattr(coda.nn, "compiling", lambda: True)
    monkeypatch.setattr(type(attn), "inductor_under_compile", inductor)
    attn(torch.randn(2, 8, 64, dtype=torch.bfloat16), None, None)
    assert seen == ([(4, False)] if inductor else [(2, True)])


@pytest.mark.parametrize("d,nh,nkv,M", [(8, 2, 1, 64), (16, 4, 2, 24), (6, 2, 1, 40)])
def test_qkv_dispatcher_outputs_equal_the_eager_views(d, nh, nkv, M):
    """Under the dispatcher (torch.compile) coda::rmsnorm_linear_rope_qkv returns q, k, v as tensors of their own
    (a custom op's outputs may not alias): one GEMM per block where every block is a multiple of 8 columns (d 8,
    16), else copies of the one GEMM's column blocks (d 6: k, v of 6 columns); either way equal to the eager views
    (bf16 on the CPU reference path), contiguous, sharing no storage, the residual a copy of x."""
    from coda.ops import attention as att
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    K, N = 32, (nh + 2 * nkv) * d
    x = torch.randn(M, K, generator=g).bfloat16()
    gam, w = (1 + 0.1 * torch.randn(K, generator=g)).bfloat16(), (torch.randn(N, K, generator=g) / 8).bfloat16()
    pos, fr = torch.arange(M, dtype=torch.float32), rope_freqs(d, nh + 2 * nkv, rotary_heads=nh + nkv)
    args = (x, gam, w, pos, fr, 1e-6, nh * d, nkv * d, True)
    want = att._qkv_views(*args)
    got = torch.ops.coda.rmsnorm_linear_rope_qkv.default(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ptrs = [t.untyped_storage().data_ptr() for t in got[:4]]
    assert all(t.is_contiguous() for t in got[:4]) and len(set(ptrs)) == 4 and ptrs[3] != x.data_ptr()
