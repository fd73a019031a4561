"""Qwen3's QK-norm + RoPE in the QKV GEMM's epilogue (``epilogues.rope.rope_qknorm``, issue 30): the reference
against a Hugging Face-style Qwen3 projection in float64 (half-split weights, per-head RMSNorm of q and k, then
``rotate_half`` RoPE), its derived backward against autograd, and the sm_90a build of the kernel's segment-sum
pre-pass."""
import pytest
import torch

import coda
from coda.autodiff import backward_epilogue, grad_name
from coda.dsl import ODD_OUT
from coda.epilogues.rope import permute_half_split, qknorm_operands, rope_freqs, rope_qknorm


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
