"""Qwen3's QK-norm + RoPE in the QKV GEMM's epilogue (``epilogues.rope.rope_qknorm``, issue 30): the reference
against a Hugging Face-style Qwen3 projection in float64 (half-split weights, per-head RMSNorm of q and k, then
``rotate_half`` RoPE), its derived backward against autograd, and the sm_90a build of the kernel's segment-sum
pre-pass."""
import pytest
import torch

import coda
from coda.autodiff import backward_epilogue, grad_name
from coda.dsl import ODD_OUT
from coda.epilogues.rope import _head_perm, permute_half_split, qknorm_operands, rope_freqs, rope_qknorm
from test_ce_grad import needs_cutlass, sm90a_ptx


def _hf_qwen3(hn, wq, wk, wv, qn, kn, pos, d, eps, base=10000.0):
    """q, k, v as Qwen3's attention forms them from the normed hidden states hn (rows), float64."""
    M = hn.shape[0]
    q, k, v = (hn @ w.T for w in (wq, wk, wv))
    q, k = (t.unflatten(1, (-1, d)) for t in (q, k))
    q, k = ((t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)) * n for t, n in ((q, qn), (k, kn)))
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    ang = pos.double().unsqueeze(1) * inv.double()
    emb = torch.cat((ang, ang), -1).unsqueeze(1)
    cos, sin = emb.cos(), emb.sin()

    def rot(t):
        return torch.cat((-t[..., d // 2:], t[..., :d // 2]), -1)
    q, k = (t * cos + rot(t) * sin for t in (q, k))
    return q.reshape(M, -1), k.reshape(M, -1), v


@pytest.mark.parametrize("d,nq,nk", [(8, 4, 2), (16, 2, 1)])
def test_rope_qknorm_reference_matches_qwen3(d, nq, nk):
    g = torch.Generator().manual_seed(d)
    M, H, eps = 11, 24, 1e-6
    h = torch.randn(M, H, generator=g, dtype=torch.float64)
    r = torch.rand(M, generator=g, dtype=torch.float64) + 0.5
    wq, wk, wv = (torch.randn(n * d, H, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    qn, kn = (torch.rand(d, generator=g, dtype=torch.float64) + 0.5 for _ in range(2))
    pos = torch.arange(M, dtype=torch.float32) * 7
    want = _hf_qwen3(h * r.unsqueeze(1), wq, wk, wv, qn, kn, pos, d, eps)
    w = torch.cat((permute_half_split(wq, d), permute_half_split(wk, d), wv))
    we, wo, qk = qknorm_operands(qn, kn, d, nq, nk, nk)
    got = coda.reference.gemm_wide(h, w, epilogue=rope_qknorm(d), r=r, pos=pos,
                                   freq=rope_freqs(d, nq + 2 * nk, rotary_heads=nq + nk).double(),
                                   w_even=we.double(), w_odd=wo.double(), qk=qk.double(), eps=eps)
    nqd, nkd = nq * d, nk * d
    torch.testing.assert_close(got[:, :nqd], permute_half_split(want[0].T, d).T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[:, nqd:nqd + nkd], permute_half_split(want[1].T, d).T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[:, nqd + nkd:], want[2], rtol=1e-12, atol=1e-12)


def test_rope_qknorm_backward_matches_autograd():
    """dacc and the norm weights' gradients of the derived program vs float64 autograd of the same epilogue."""
    d, nq, nk = 8, 2, 1
    g = torch.Generator().manual_seed(5)
    M, N = 6, (nq + 2 * nk) * d
    acc = torch.randn(M, N, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.rand(M, generator=g, dtype=torch.float64) + 0.5
    pos = torch.arange(M, dtype=torch.float64) * 3
    freq = rope_freqs(d, nq + 2 * nk, rotary_heads=nq + nk).double()
    we, wo, qk = (t.double() for t in qknorm_operands(torch.rand(d, generator=g) + 0.5,
                                                      torch.rand(d, generator=g) + 0.5, d, nq, nk, nk))
    we, wo = we.requires_grad_(), wo.requires_grad_()
    epi = rope_qknorm(d)
    out = epi.reference(acc, r=r, pos=pos, freq=freq, w_even=we, w_odd=wo, qk=qk, eps=1e-5)["out"]
    up = torch.randn(out.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((out * up).sum(), (acc, we, wo))
    bwd = backward_epilogue(epi, ("out",), ("w_even", "w_odd"))
    got = bwd.reference(acc.detach(), r=r, pos=pos, freq=freq, w_even=we.detach(), w_odd=wo.detach(), qk=qk,
                        eps=1e-5, **{grad_name("out"): up[:, 0::2], grad_name(ODD_OUT): up[:, 1::2]})
    assert bwd.pair_mode == "full"  # (dacc's pairs interleaved back into one M x N result)
    torch.testing.assert_close(got["out"], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got["d_w_even"], want[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got["d_w_odd"], want[2], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("d,cfg", [(128, dict()), (64, dict(tile_m=64, pingpong=True))])
def test_rope_qknorm_builds_for_sm90(d, cfg):
    from coda.check import compile_variant
    from coda.config import GemmConfig
    row = compile_variant(GemmConfig(**cfg), rope_qknorm(d))
    assert row["ok"], row["error"]
    assert row["spill_bytes"] == 0


def test_rope_qknorm_arguments():
    with pytest.raises(ValueError, match="head_dim"):
        rope_qknorm(7)
    assert rope_qknorm(64) is rope_qknorm(64)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(), dict(tile_m=64, pingpong=True)], ids=["coop", "pp"])
def test_rope_qknorm_kernel_matches_float64(cfg):
    """The kernel (segment-sum pre-pass in pairs, heads of 128 inside 256-column tiles) on a Qwen3-like QKV
    projection with ragged M and K: every element written (NaN-poisoned), float64 2x rule against torch's bf16."""
    from coda.config import GemmConfig
    d, nq, nk, M, H = 128, 4, 2, 1000, 520
    g = torch.Generator().manual_seed(1)
    dev = dict(device="cuda")
    h = torch.randn(M, H, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn((nq + 2 * nk) * d, H, generator=g) / H ** 0.5).to(torch.bfloat16).cuda()
    r = (torch.rand(M, generator=g) + 0.5).cuda()
    we, wo, qk = (t.cuda() for t in qknorm_operands(torch.rand(d, generator=g) + 0.5,
                                                   torch.rand(d, generator=g) + 0.5, d, nq, nk, nk))
    ops = dict(r=r, pos=torch.arange(M, **dev, dtype=torch.float32), w_even=we, w_odd=wo, qk=qk, eps=1e-6,
               freq=rope_freqs(d, nq + 2 * nk, rotary_heads=nq + nk, device="cuda"))
    out = torch.full((M, w.shape[0]), float("nan"), **dev, dtype=torch.bfloat16)
    got = coda.gemm(h, w, epilogue=rope_qknorm(d), out=out, config=GemmConfig(**cfg), **ops)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any()
    wide = {k: (v.double() if torch.is_tensor(v) and v.dtype == torch.float32 else v) for k, v in ops.items()}
    ref = coda.reference.gemm_wide(h.double(), w.double(), epilogue=rope_qknorm(d), **wide)
    theirs = coda.reference.gemm_wide(h, w, epilogue=rope_qknorm(d), **ops).bfloat16().double()
    mine = ((got.double() - ref).norm() / ref.norm()).item()
    assert mine <= 2 * ((theirs - ref).norm() / ref.norm()).item() + 1e-3, mine


# ------------------------------------------------------------------ the saved pre-norm values and the backward pass
def _qk_forward(acc_q, acc_k, acc_v, r, pos, freqs, wq, wk, d, eps):
    """The fused QKV GEMM's three blocks in float64 (``rope_qknorm(d, save_x=True)`` on q and k, r on v)."""
    from coda.epilogues.rope import rope_rmsnorm
    outs, c0 = [], 0
    for acc, w in ((acc_q, wq), (acc_k, wk)):
        n = acc.shape[1]
        wp = w[_head_perm(d)].repeat(n // d)  # (qknorm_operands' layout, differentiable)
        outs.append(rope_qknorm(d, save_x=True).reference(acc, r=r, pos=pos, freq=freqs[c0 // 2:(c0 + n) // 2],
                                                          w_even=wp[0::2], w_odd=wp[1::2], eps=eps))
        c0 += n
    v = rope_rmsnorm.reference(acc_v, r=r, pos=pos, freq=freqs[c0 // 2:])["out"]
    return outs, v


@pytest.mark.parametrize("d,nq,nk", [(8, 4, 2), (16, 2, 1)])
def test_save_x_writes_the_prenorm_values(d, nq, nk):
    g = torch.Generator().manual_seed(3)
    M = 7
    acc = torch.randn(M, nq * d, generator=g, dtype=torch.float64)
    r = torch.rand(M, generator=g, dtype=torch.float64) + 0.5
    freqs = rope_freqs(d, nq).double()
    pos = torch.arange(M, dtype=torch.float64) * 5
    we, wo, qk = (t.double() for t in qknorm_operands(torch.rand(d, generator=g) + 0.5, torch.ones(d), d, nq, 0, 0))
    res = rope_qknorm(d, save_x=True).reference(acc, r=r, pos=pos, freq=freqs, w_even=we, w_odd=wo, eps=1e-6)
    plain = rope_qknorm(d).reference(acc, r=r, pos=pos, freq=freqs, w_even=we, w_odd=wo, qk=qk, eps=1e-6)["out"]
    torch.testing.assert_close(res["x"], acc * r[:, None], rtol=0, atol=0)
    torch.testing.assert_close(res["out"], plain, rtol=0, atol=0)
    assert rope_qknorm(d, save_x=True).outputs == ("x",) and rope_qknorm(d, save_x=True).pair_mode == "full"


@pytest.mark.parametrize("d,nq,nk", [(8, 4, 2), (16, 2, 1)])
def test_rope_grad_qknorm_reference_matches_autograd(d, nq, nk):
    """dacc, dr and the norm weights' gradients of ``rope_grad_qknorm``'s reference vs float64 autograd through the
    forward epilogues (q, k with the QK-norm, v with r only)."""
    from coda.kernels.rope_grad import rope_grad_qknorm
    g = torch.Generator().manual_seed(d + nq)
    M, eps = 9, 1e-5
    accs = [torch.randn(M, n * d, generator=g, dtype=torch.float64, requires_grad=True) for n in (nq, nk, nk)]
    r = (torch.rand(M, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    wq, wk = ((torch.rand(d, generator=g, dtype=torch.float64) + 0.5).requires_grad_() for _ in range(2))
    freqs = rope_freqs(d, nq + 2 * nk, rotary_heads=nq + nk).double()
    pos = torch.arange(M, dtype=torch.float64) * 3
    (oq, ok), v = _qk_forward(*accs, r, pos, freqs, wq, wk, d, eps)
    ups = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (oq["out"], ok["out"], v)]
    loss = sum((u * t).sum() for u, t in zip(ups, (oq["out"], ok["out"], v)))
    want = torch.autograd.grad(loss, (*accs, r, wq, wk))
    # the pairs-order weights as the op passes them: the model's half-split weight permuted like W_q's rows
    perm = _head_perm(d)
    wcat = torch.cat((wq.detach()[perm], wk.detach()[perm]))
    dacc, dr, dw = rope_grad_qknorm(ups, (oq["x"].detach(), ok["x"].detach()), v.detach(), pos.float(),
                                    freqs.float(), r.detach(), wcat, eps, d)
    torch.testing.assert_close(dacc, torch.cat(want[:3], 1), rtol=1e-9, atol=1e-11)  # r dL/dx = dL/dacc
    torch.testing.assert_close(dr, want[3], rtol=1e-9, atol=1e-11)
    inv = perm.argsort()
    torch.testing.assert_close(dw[0][inv], want[4], rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(dw[1][inv], want[5], rtol=1e-9, atol=1e-11)


def test_rope_grad_qknorm_arguments():
    from coda.kernels.rope_grad import rope_grad_qknorm
    g = [torch.randn(4, n) for n in (16, 16, 16)]
    pos, fr, r, w = torch.zeros(4), torch.zeros(24), torch.rand(4) + 0.5, torch.ones(16)
    with pytest.raises(ValueError, match="head_dim"):
        rope_grad_qknorm(g, g[:2], g[2], pos, fr, r, w, 1e-6, 12)
    with pytest.raises(ValueError, match="whole heads"):
        rope_grad_qknorm(g, g[:2], g[2], pos, fr, r, torch.ones(32), 1e-6, 16 * 2)
    with pytest.raises(ValueError, match="weight"):
        rope_grad_qknorm(g, g[:2], g[2], pos, fr, r, w[:8], 1e-6, 8)


@needs_cutlass
def test_rope_grad_qknorm_builds_for_sm90():
    import re

    from coda.kernels import rope_grad as rg
    for d in (128, 64):
        text, out = sm90a_ptx(rg.compile_kernel, torch.bfloat16, d)
        # q and k: dy, x, 4 frequencies and 2 x 4 weights as 16-byte loads; v: dy, v, frequencies; 3 stores
        assert len(re.findall(r"ld\.global[.a-z0-9]*\.v4", text)) == 13
        assert len(re.findall(r"st\.global[.a-z0-9]*\.v4", text)) == 3
        assert not re.findall(r"\b(?:ld|st)\.local", text)
        if out is not None:
            assert "0 bytes spill stores" in out


@pytest.mark.parametrize("cfg", [dict(), dict(tile_m=64, pingpong=True)], ids=["coop", "pp"])
def test_rope_qknorm_save_x_builds_for_sm90(cfg):
    from coda.check import compile_variant
    from coda.config import GemmConfig
    row = compile_variant(GemmConfig(**cfg), rope_qknorm(128, save_x=True))
    assert row["ok"], row["error"]
    assert row["spill_bytes"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(), dict(tile_m=64, pingpong=True)], ids=["coop", "pp"])
def test_rope_qknorm_save_x_kernel_matches_float64(cfg):
    """The q block's GEMM with the saved pre-norm values: both outputs against float64, ragged M and K, the main
    output NaN-poisoned, the extra one checked for every element (finite inputs give finite values)."""
    from coda.config import GemmConfig
    d, nq, M, H = 128, 4, 1000, 520
    g = torch.Generator().manual_seed(2)
    h = torch.randn(M, H, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(nq * d, H, generator=g) / H ** 0.5).to(torch.bfloat16).cuda()
    we, wo, _ = (t.cuda() for t in qknorm_operands(torch.rand(d, generator=g) + 0.5, torch.ones(d), d, nq, 0, 0))
    ops = dict(r=(torch.rand(M, generator=g) + 0.5).cuda(), pos=torch.arange(M, device="cuda", dtype=torch.float32),
               freq=rope_freqs(d, nq, device="cuda"), w_even=we, w_odd=wo, eps=1e-6)
    out = torch.full((M, nq * d), float("nan"), device="cuda", dtype=torch.bfloat16)
    epi = rope_qknorm(d, save_x=True)
    got = coda.gemm(h, w, epilogue=epi, out=out, config=GemmConfig(**cfg), **ops)
    torch.cuda.synchronize()
    assert got["out"].data_ptr() == out.data_ptr() and not out.isnan().any() and got["x"].isfinite().all()
    wide = {k: (v.double() if torch.is_tensor(v) and v.dtype == torch.float32 else v) for k, v in ops.items()}
    ref = coda.reference.gemm_wide(h.double(), w.double(), epilogue=epi, **wide)
    theirs = coda.reference.gemm_wide(h, w, epilogue=epi, **ops)
    for k in ("out", "x"):
        mine = ((got[k].double() - ref[k]).norm() / ref[k].norm()).item()
        torch_err = ((theirs[k].bfloat16().double() - ref[k]).norm() / ref[k].norm()).item()
        assert mine <= 2 * torch_err + 1e-3, (k, mine, torch_err)


@pytest.mark.gpu
@pytest.mark.parametrize("M,d,heads", [(1001, 128, (4, 2, 2)), (8192, 128, (16, 8, 8)), (13, 64, (2, 1, 1))])
def test_rope_grad_qknorm_kernel_matches_float64(M, d, heads):
    """The QK-norm backward pass vs its float64 reference: dacc, dr, the weights' gradients (summed over rows:
    the CTA partials), ragged M, gradients as column blocks of one buffer, a NaN that stays in its head and row."""
    from coda.kernels.rope_grad import rope_grad_qknorm
    g = torch.Generator(device="cuda").manual_seed(M)
    widths = tuple(n * d for n in heads)
    big = torch.randn(M, sum(widths), generator=g, device="cuda").to(torch.bfloat16)
    grads = list(big.split(widths, 1))
    xs = [(3 * torch.randn(M, n, generator=g, device="cuda")).to(torch.bfloat16) for n in widths[:2]]
    v = torch.randn(M, widths[2], generator=g, device="cuda").to(torch.bfloat16)
    grads[0][M // 2, 3] = float("nan")
    pos = torch.randint(0, 131072, (M,), generator=g, device="cuda").float()
    fr = rope_freqs(d, sum(heads), rotary_heads=heads[0] + heads[1], base=1e6, device="cuda")
    r = torch.rand(M, generator=g, device="cuda") + 0.05
    w = torch.rand(2 * d, generator=g, device="cuda") + 0.5
    dacc, dr, dw = rope_grad_qknorm(grads, xs, v, pos, fr, r, w, 1e-6, d)
    want = rope_grad_qknorm([t.double().cpu() for t in grads], [t.double().cpu() for t in xs], v.double().cpu(),
                            pos.cpu(), fr.cpu(), r.double().cpu(), w.double().cpu(), 1e-6, d)
    row = M // 2
    assert torch.isnan(dacc[row, :d]).all() and torch.isnan(dr[row])  # the NaN's head and row
    assert torch.equal(torch.isnan(dw).cpu(), torch.isnan(want[2]))  # q's weight gradient at the NaN's two dims
    assert torch.isfinite(dacc[row, d:]).all()
    keep = torch.ones(M, dtype=torch.bool, device="cuda")
    keep[row] = False
    assert torch.isfinite(dacc[keep]).all() and torch.isfinite(dr[keep]).all() and torch.isfinite(dw[1]).all()
    wd = want[0].cuda()[keep]
    err = (dacc[keep].double() - wd).abs().max().item()
    assert err <= 2 ** -7 * wd.abs().max().item(), err  # bf16 rounding of the output
    wr = want[1].cuda()[keep]
    assert ((dr[keep].double() - wr).abs() <= 1e-4 * wr.abs().max() + 1e-6).all()
    fin = torch.isfinite(want[2])
    ref_w = want[2][fin]  # the weights' gradients where finite (k's everywhere: the NaN is in q's rows only)
    assert ((dw.double().cpu()[fin] - ref_w).abs() <= 1e-4 * ref_w.abs().max() + 1e-5).all()
