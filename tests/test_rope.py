"""RoPE on the CPU: coda.sin / coda.cos in the DSL, the angle reduction of the kernel program (emulated in float32) at
positions up to 131072, the algebra (sympy: backward = rotation by -theta, z.dz preserved, half-split permutation),
coda.ops.linear_rope (reference path) vs a float64 Hugging Face style rotate_half implementation (2x rule),
torch.library.opcheck, torch.compile, argument errors, and the sm_90a compile of the RoPE kernels."""
import importlib
import math

import pytest
import sympy as sp
import torch

import coda
import coda.ops
from coda._eval import TorchOps, reduce_angle
from coda.autodiff import backward_epilogue, grad_name
from coda.dsl import ACC_EVEN, ACC_ODD, ODD_OUT, ProductAngle, operand_symbol
from coda.epilogues.rope import _head_perm, rope
from rope_ref import check_against_fp64, hf_rotary, rel, rotate_half

rope_ops = importlib.import_module("coda.ops.rope")  # the module (coda.ops.linear_rope is the function)
X, Y, POS, FREQ = ACC_EVEN, ACC_ODD, operand_symbol("pos"), operand_symbol("freq")
GX, GY = operand_symbol(grad_name("out")), operand_symbol(grad_name(ODD_OUT))
TH = POS * FREQ


class KernelEmu(TorchOps):
    """The kernel's program on float32 tensors: fp32 arithmetic and the kernel's angle reduction (``reduce_angle``,
    the code CuteOps runs). fma is emulated in float64 (the product of two fp32 values is exact there; the sum is
    rounded twice, which can differ from a true fma by one fp32 ulp in rare ties)."""

    def angle(self, coef, factors): return reduce_angle(self, coef, factors)
    def mul_rn(self, a, b): return a * b
    def add_rn(self, a, b): return a + b
    def fma(self, a, b, c): return (a.double() * b.double() + c.double()).float()
    def rint(self, x): return torch.round(x)  # half to even, as cvt.rni


def kernel_program(epi, acc_even, acc_odd, **operands):
    """Evaluate ``epi`` (a pairs epilogue) the way its kernel code does, on float32 tensors."""
    leaves = {ACC_EVEN: acc_even, ACC_ODD: acc_odd}
    for o in epi.operands:
        v = operands[o.name]
        leaves[operand_symbol(o.name)] = v.unsqueeze(-1) if o.kind == "vec_m" else v
    return epi._evaluate(leaves, KernelEmu(acc_even))


LLAMA_FREQS = coda.ops.rope_freqs(128, 1)  # Llama head_dim 128: 64 frequencies from 1 down to ~1.2e-4
ALL_POS = torch.arange(0, 131073, dtype=torch.float32)  # every position up to 131072


# ------------------------------------------------------------------------------------------ angle accuracy
def test_kernel_angle_reduction_at_131072_positions():
    """cos / sin of pos * freq as the kernel computes them, for every position 0..131072 and Llama's 64
    frequencies, vs float64; the plain fp32 product (what a straightforward fp32 implementation does) for scale."""
    one, zero = torch.ones(ALL_POS.numel(), 64), torch.zeros(ALL_POS.numel(), 64)
    res = kernel_program(rope, one, zero, pos=ALL_POS, freq=LLAMA_FREQS)  # (1, 0) rotated = (cos, sin)
    theta = ALL_POS.double()[:, None] * LLAMA_FREQS.double()
    err_ours = max((res["out"].double() - theta.cos()).abs().max().item(),
                   (res[ODD_OUT].double() - theta.sin()).abs().max().item())
    naive = ALL_POS[:, None] * LLAMA_FREQS
    err_naive = max((naive.cos().double() - theta.cos()).abs().max().item(),
                    (naive.sin().double() - theta.sin()).abs().max().item())
    print(f"max |error| of cos/sin at positions <= 131072: kernel program {err_ours:.2e}, fp32 product "
          f"{err_naive:.2e}")
    assert err_ours < 5e-7  # measured 2.4e-7
    assert err_naive > 1e-3  # measured 3.9e-3: the test sees the problem it guards against


@pytest.mark.parametrize("make,exact", [
    (lambda p, f: coda.sin(p * f * 2), lambda p, f: torch.sin(p * f * 2)),
    (lambda p, f: coda.cos(p * f / 3), lambda p, f: torch.cos(p * f / 3)),
    (lambda p, f: coda.sin(-(f * p)), lambda p, f: -torch.sin(p * f)),  # sympy pulls the sign out: -sin(f p)
    (lambda p, f: coda.cos(p * (f * 2 * math.pi)), lambda p, f: torch.cos(p * f * 2 * math.pi)),  # merged consts
    (lambda p, f: coda.cos(f * p), lambda p, f: torch.cos(p * f)),
], ids=["times2", "over3", "negated", "times2pi", "commuted"])
def test_product_angle_canonical_forms(make, exact):
    """Whatever form sympy gives the product (constants merged in, signs pulled out, factors reordered), the kernel
    program and the reference reduce the exact angle."""
    @coda.epilogue
    def e(acc, pos: coda.VecM, freq: coda.VecN):
        x, y = coda.pairs(acc)
        return x * make(pos, freq), y
    program = [v for _, v in e._cse_repl] + list(e._cse_out.values())
    assert any(sub.has(ProductAngle) for sub in program)
    assert not any(v.has(ProductAngle) for v in e.exprs.values())  # evaluation only: not in the traced math / key
    pos = torch.tensor([0.0, 1.0, 4097.0, 65535.0, 100003.0, 131071.0])
    freq = LLAMA_FREQS[[0, 1, 7, 30, 63]]
    want = exact(pos.double()[:, None], freq.double())
    ones = torch.ones(pos.numel(), freq.numel())
    got_kernel = kernel_program(e, ones, ones, pos=pos, freq=freq)["out"].double()
    got_ref = e.reference(torch.ones(pos.numel(), 2 * freq.numel()), pos=pos, freq=freq)["out"][:, 0::2].double()
    assert (got_kernel - want).abs().max() < 1e-6
    assert (got_ref - want).abs().max() < 1e-6


def test_reduce_angle_more_factors_and_nonfinite():
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.rand(4096, generator=g) * s for s in (300.0, 500.0, 2.0))
    got = reduce_angle(KernelEmu(a), 0.1, [a, b, c]).double()  # |angle| up to 3e4 rad
    exact = 0.1 * a.double() * b.double() * c.double()
    assert (got.sin() - exact.sin()).abs().max() < 2e-6 and (got.cos() - exact.cos()).abs().max() < 2e-6
    bad = reduce_angle(KernelEmu(a), 1.0, [torch.tensor([math.inf, math.nan, 1.0]), torch.tensor([1.0, 1.0, 2.0])])
    assert bad[:2].isnan().all() and bad[2].item() == 2.0


# ------------------------------------------------------------------------------------------ the algebra (sympy)
def _rot(theta, a, b):
    return a * sp.cos(theta) - b * sp.sin(theta), a * sp.sin(theta) + b * sp.cos(theta)


def test_rope_algebra():
    """Forward = R(theta); the backward coda.autodiff derives (what linear_rope runs) = R(-theta) of the upstream
    gradient, independent of the accumulator; z . dz = z' . dz' (so the RMSNorm backward's ZdZ is unchanged)."""
    assert rope.pair_mode == "full" and [(o.name, o.kind) for o in rope.operands] == [("pos", "vec_m"),
                                                                                      ("freq", "vec_n")]
    fx, fy = _rot(TH, X, Y)
    assert sp.simplify(rope.exprs["out"] - fx) == 0 and sp.simplify(rope.exprs[ODD_OUT] - fy) == 0
    bwd = backward_epilogue(rope, ("out",), ())
    assert bwd.pair_mode == "full" and not bwd.symbols & {X, Y}  # no accumulator: a K = 0 GEMM can run it
    bx, by = _rot(-TH, GX, GY)
    assert sp.simplify(bwd.exprs["out"] - bx) == 0 and sp.simplify(bwd.exprs[ODD_OUT] - by) == 0
    # it is the derivative: d(gx x' + gy y')/dx, /dy
    loss = GX * fx + GY * fy
    assert sp.simplify(sp.diff(loss, X) - bx) == 0 and sp.simplify(sp.diff(loss, Y) - by) == 0
    assert sp.simplify((X * bx + Y * by) - (fx * GX + fy * GY)) == 0  # z . dz == z' . dz'


def _half_split_case(d, r):
    """One head of dim d with rotary dim r: HF rotate_half on q vs rope on the permuted q (symbolic)."""
    q = sp.symbols(f"q0:{d}", real=True)
    k = sp.symbols(f"k0:{d}", real=True)
    pq, pk = sp.symbols("p_q p_k", real=True)
    f = sp.symbols(f"f0:{r // 2}", positive=True)

    def hf(v, p):  # q_rot * cos(emb) + rotate_half(q_rot) * sin(emb), emb = cat(p f, p f); pass-through after r
        emb = [p * f[i % (r // 2)] for i in range(r)]
        rh = [-v[i + r // 2] for i in range(r // 2)] + [v[i] for i in range(r // 2)]
        return [v[i] * sp.cos(emb[i]) + rh[i] * sp.sin(emb[i]) for i in range(r)] + list(v[r:])

    perm = _head_perm(d, r).tolist()  # the permutation permute_half_split applies to the weight rows

    def ours(v, p):  # adjacent pairs (2i, 2i+1) of the permuted vector rotated by p * freq[i] (rope_freqs layout)
        w = [v[j] for j in perm]
        out = list(w)
        for i in range(d // 2):
            theta = p * f[i] if i < r // 2 else 0  # freq 0 past the rotary part
            out[2 * i], out[2 * i + 1] = _rot(theta, w[2 * i], w[2 * i + 1])
        return out

    hq, hk, oq, ok = hf(q, pq), hf(k, pk), ours(q, pq), ours(k, pk)
    assert all(sp.simplify(oq[i] - hq[perm[i]]) == 0 for i in range(d))  # ours = P (HF result)
    dot = sp.simplify(sum(a * b for a, b in zip(oq, ok)) - sum(a * b for a, b in zip(hq, hk)))
    assert dot == 0  # the attention scores q . k are unchanged


@pytest.mark.parametrize("d,r", [(6, 6), (8, 4)])
def test_half_split_permutation_equivalence(d, r):
    _half_split_case(d, r)


def test_permute_half_split_helpers():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads of dim 8
    p = coda.ops.permute_half_split(w, 8)
    assert p.shape == w.shape and p.is_contiguous()
    assert [int(v) for v in p[:8, 0] // 3] == [0, 4, 1, 5, 2, 6, 3, 7]  # rows i, i + d/2 adjacent
    assert [int(v) for v in p[8:, 0] // 3] == [8, 12, 9, 13, 10, 14, 11, 15]  # per head
    assert torch.equal(coda.ops.unpermute_half_split(p, 8), w)
    pr = coda.ops.permute_half_split(w, 8, rotary_dim=4)  # partial rotary: (0, 2), (1, 3), then 4..7 in place
    assert [int(v) for v in pr[:8, 0] // 3] == [0, 2, 1, 3, 4, 5, 6, 7]
    assert torch.equal(coda.ops.unpermute_half_split(pr, 8, rotary_dim=4), w)
    b = torch.arange(8.0)  # 1-D (a q / k bias)
    assert coda.ops.permute_half_split(b, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(ValueError, match="multiple of head_dim=8"):
        coda.ops.permute_half_split(torch.randn(12, 3), 8)
    with pytest.raises(ValueError, match="head_dim must be a positive even int"):
        coda.ops.permute_half_split(w, 7)
    with pytest.raises(ValueError, match=r"rotary_dim must be an even int in \(0, head_dim=8\]"):
        coda.ops.unpermute_half_split(w, 8, rotary_dim=10)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        coda.ops.permute_half_split([1.0], 2)


def test_rope_freqs():
    f = coda.ops.rope_freqs(8, 5, base=500000.0, rotary_heads=3)  # e.g. q (2 heads) + k (1) + v (2)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 8, 2, dtype=torch.int64).float() / 8))  # HF LlamaRotaryEmbedding
    assert f.dtype == torch.float32 and f.shape == (20,)
    assert torch.equal(f[:12], inv.repeat(3)) and not f[12:].any()
    assert f[0] == 1.0
    part = coda.ops.rope_freqs(8, 1, rotary_dim=4)
    assert torch.equal(part[:2], 1.0 / (10000.0 ** (torch.tensor([0.0, 2.0]) / 4))) and not part[2:].any()
    scaled = coda.ops.rope_freqs(8, 2, scaling=lambda v: v / 8)
    assert torch.equal(scaled, coda.ops.rope_freqs(8, 2) / 8)
    for kwargs, match in (({"head_dim": 7}, "head_dim must be even"), ({"n_heads": 0}, "n_heads must be a positive"),
                          ({"rotary_heads": 3}, r"rotary_heads must be an int in \[0, n_heads=2\]"),
                          ({"rotary_dim": 3}, "rotary_dim must be an even int"), ({"base": -1.0}, "base must be"),
                          ({"scaling": lambda v: v[:1]}, "scaling must return 4 frequencies")):
        with pytest.raises(ValueError, match=match):
            coda.ops.rope_freqs(**{"head_dim": 8, "n_heads": 2, **kwargs})


# ------------------------------------------------------------------------------------------ numerics
def test_reference_vs_float64_rotate_half_at_131072():
    """coda.reference.gemm with the rope epilogue (fp32 output; HF weights permuted once) vs the HF-style rotate_half
    computation in float64, at positions up to 131072; beside it the same HF computation in fp32 (fp32 angles)."""
    g = torch.Generator().manual_seed(0)
    M, K, hd, H = 257, 64, 128, 2
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(H * hd, K, generator=g) / 8).bfloat16()
    pos = torch.randint(0, 131072, (M,), generator=g)
    pos[-1] = 131071
    freqs = coda.ops.rope_freqs(hd, H)
    y = coda.reference.gemm(x, coda.ops.permute_half_split(w, hd), epilogue=rope, pos=pos.float(), freq=freqs,
                            out_dtype=torch.float32)
    y = coda.ops.unpermute_half_split(y.T, hd).T
    heads = lambda dt: (x.to(dt) @ w.to(dt).T).unflatten(-1, (H, hd))  # noqa: E731
    want = hf_rotary(heads(torch.float64), pos, freqs[:hd // 2], hd, fp64=True).flatten(-2)
    naive = hf_rotary(heads(torch.float32), pos, freqs[:hd // 2], hd).flatten(-2)
    e_ours, e_naive = rel(y, want), rel(naive, want)
    print(f"relative error vs float64 at positions <= 131072: ours {e_ours:.2e}, fp32 HF-style {e_naive:.2e}")
    assert e_ours < 1e-6 and e_naive > 1e-4  # measured 8e-8 and 4e-4


@pytest.mark.parametrize("lead,K,hd,heads,rot_heads,rot_dim", [
    ((37,), 64, 16, 6, 4, None),  # ragged M; a fused q (2 heads) + k (2) + v (2) with v unrotated
    ((3, 13), 32, 32, 2, None, None),  # batched x
    ((2, 5), 24, 8, 3, 2, 4),  # partial rotary (GPT-NeoX style)
    ((1,), 16, 8, 1, None, None),
])
def test_matches_fp64_autograd(lead, K, hd, heads, rot_heads, rot_dim):
    check_against_fp64(lead, K, hd, heads, rot_heads, rot_dim)


def test_fp16():
    check_against_fp64((37,), 32, 16, 4, 3, dtype=torch.float16)


def test_same_programs_as_ops_linear():
    """The op's forward is coda.ops.linear's (bitwise), and its backward (a K = 0 GEMM running the derived rotation
    by -theta, then dX / dW) matches ops.linear's backward bitwise on the reference path."""
    torch.manual_seed(0)
    x = torch.randn(2, 11, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(48, 32, dtype=torch.bfloat16) / 6).requires_grad_()
    pos, freqs = torch.randint(0, 131072, (2, 11)), coda.ops.rope_freqs(16, 3)
    dy = torch.randn(2, 11, 48, dtype=torch.bfloat16)
    a = coda.ops.linear_rope(x, w, pos, freqs)
    b = coda.ops.linear(x, w, epilogue=rope, pos=pos.float(), freq=freqs)
    assert torch.equal(a, b)
    for ga, gb in zip(torch.autograd.grad(a, (x, w), dy), torch.autograd.grad(b, (x, w), dy)):
        assert torch.equal(ga, gb)


def test_positions_broadcast_dtypes_partial_grads_and_empty():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 16, dtype=torch.bfloat16)  # frozen: no dW product
    freqs = coda.ops.rope_freqs(8, 2)
    full = torch.arange(7).expand(2, 7)
    y = coda.ops.linear_rope(x, w, full, freqs)
    for p in (torch.arange(7), torch.arange(7, dtype=torch.int32), torch.arange(7.0), full[:1]):
        assert torch.equal(coda.ops.linear_rope(x, w, p, freqs), y)  # broadcast over the batch, int or fp32
    (dx,) = torch.autograd.grad(y.float().sum(), (x,))
    assert dx.shape == x.shape
    x0 = torch.randn(0, 16, dtype=torch.bfloat16, requires_grad=True)
    w.requires_grad_()
    y0 = coda.ops.linear_rope(x0, w, torch.zeros(0, dtype=torch.int64), freqs)
    assert y0.shape == (0, 16)
    dx0, dw0 = torch.autograd.grad(y0.sum(), (x0, w))
    assert dx0.shape == (0, 16) and dw0.shape == (16, 16) and not dw0.any()


# ---------------------------------------------------------------------------------- torch integration
def _inputs(M=24, K=32, N=48, grad=True):
    torch.manual_seed(0)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16) / K ** 0.5
    pos = torch.randint(0, 131072, (M,)).float()
    return x.requires_grad_(grad), w.requires_grad_(grad), pos, coda.ops.rope_freqs(16, N // 16)


def test_opcheck():
    x, w, pos, freqs = _inputs()
    torch.library.opcheck(torch.ops.coda.linear_rope.default, (x, w, pos, freqs))
    dy = torch.randn(24, 48, dtype=torch.bfloat16)
    for need in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(torch.ops.coda.linear_rope_backward.default,
                              (dy, x.detach(), w.detach(), pos, freqs, *need))


def test_torch_compile_fullgraph():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()

    def attn_proj(x, w, pos, freqs):
        qk = coda.ops.linear_rope(x, w, pos, freqs)
        return (qk[:, :16] * qk[:, 16:32]).float().sum() + qk.float().square().sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attn_proj, fullgraph=True, backend=counter)
    for m in (24, 40):
        x, w, pos, freqs = _inputs(M=m)
        loss = compiled(x, w, pos, freqs)
        grads = torch.autograd.grad(loss, (x, w))
        loss_eager = attn_proj(x, w, pos, freqs)
        want = torch.autograd.grad(loss_eager, (x, w))
        torch.testing.assert_close(loss, loss_eager)
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b)
    assert "torch.ops.coda.linear_rope" in counter.graphs[0].code  # an opaque node


# ----------------------------------------------------------------------------------------------- errors
BF = torch.bfloat16


@pytest.mark.parametrize("args,exc,match", [
    (dict(x=[1.0]), TypeError, "x must be a torch.Tensor"),
    (dict(positions=[0, 1]), TypeError, "positions must be a torch.Tensor"),
    (dict(x=torch.randn(4, 32)), TypeError, "x must be bfloat16 or float16"),
    (dict(weight=torch.randn(48, 32, dtype=torch.float16)), TypeError, "weight must have x's dtype"),
    (dict(positions=torch.zeros(4, dtype=BF)), TypeError, "positions must be int64, int32 or float32"),
    (dict(freqs=torch.zeros(24, dtype=torch.float64)), TypeError, "freqs must be float32"),
    (dict(weight=torch.randn(48, 24, dtype=BF)), ValueError, r"weight must be \(N, K\) with K=32"),
    (dict(weight=torch.randn(47, 32, dtype=BF), freqs=torch.zeros(23)), ValueError, "N=47 rows.*N must be even"),
    (dict(weight=torch.randn(44, 32, dtype=BF), freqs=torch.zeros(22)), ValueError, "N must be a multiple of 8"),
    (dict(x=torch.randn(4, 12, dtype=BF), weight=torch.randn(48, 12, dtype=BF)), ValueError,
     r"K = x.shape\[-1\] = 12 must be a multiple of 8"),
    (dict(positions=torch.zeros(5)), ValueError, r"positions must have shape \(4,\)"),
    (dict(positions=torch.zeros(4, 1)), ValueError, r"positions must have shape \(4,\)"),
    (dict(freqs=torch.zeros(48)), ValueError, r"freqs must have shape \(24,\)"),
    (dict(freqs=torch.zeros(24, requires_grad=True)), ValueError, "freqs requires grad"),
    (dict(weight=torch.randn(48, 32, dtype=BF, device="meta")), ValueError, "weight is on meta"),
    (dict(x=torch.randn(32, 4, dtype=BF).t()), ValueError, "x: the last dim must be contiguous"),
    (dict(freqs=torch.zeros(48)[::2]), ValueError, "freqs: the last dim must be contiguous"),
    (dict(x=torch.tensor(1.0, dtype=BF)), ValueError, r"x must be \(..., K\)"),
])
def test_errors_before_compute(monkeypatch, args, exc, match):
    calls = []
    monkeypatch.setattr(rope_ops, "gemm_for", lambda *a: calls.append(a))
    kw = dict(x=torch.randn(4, 32, dtype=BF), weight=torch.randn(48, 32, dtype=BF), positions=torch.arange(4),
              freqs=torch.zeros(24))
    kw.update(args)
    with pytest.raises(exc, match=match) as e:
        coda.ops.linear_rope(**kw)
    assert str(e.value).startswith("linear_rope: ") and not calls


def test_rejects_non_hopper_gpu_before_compute(monkeypatch):
    """The device rule of ops/_common.gemm_for holds (CPU here: the patched rule raises)."""
    def no_hopper(device, entry):
        raise RuntimeError(f"{entry} needs")
    monkeypatch.setattr(rope_ops, "gemm_for", no_hopper)
    x, w, pos, freqs = _inputs(grad=False)
    with pytest.raises(RuntimeError, match="coda.ops.linear_rope needs"):
        coda.ops.linear_rope(x, w, pos, freqs)


def test_dsl_sin_cos():
    """coda.sin / coda.cos on any argument: reference vs torch, sympy derivatives (cos, -sin) vs autograd."""
    @coda.epilogue
    def e(acc, v: coda.VecN, s: coda.Scalar):
        return coda.sin(acc * v) * coda.cos(acc + s) + coda.cos(2.0 * acc)

    acc = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(6, dtype=torch.float64)
    ref = torch.sin(acc * v) * torch.cos(acc + 0.3) + torch.cos(2 * acc)
    torch.testing.assert_close(e.reference(acc.detach(), v=v, s=0.3)["out"], ref.detach())
    g = torch.randn(5, 6, dtype=torch.float64)
    (want,) = torch.autograd.grad((ref * g).sum(), (acc,))
    got = backward_epilogue(e, ("out",), ()).reference(acc.detach(), v=v, s=0.3, grad_out=g)["out"]
    torch.testing.assert_close(got, want)
    k1 = coda.epilogue(lambda acc: coda.sin(acc), name="k").key()
    assert k1 != coda.epilogue(lambda acc: coda.cos(acc), name="k").key()


# ----------------------------------------------------------------------------------------------- sm_90a
@pytest.mark.parametrize("which", ["forward", "backward", "plain sin"])
def test_rope_kernels_compile_for_sm90(which):
    """The forward and the backward (rotation by -theta) epilogues compile for sm_90a on the CPU: WGMMA present, no
    spills (ptxas -v), the angle reduction in the PTX (cvt.rni.f32.f32 = rint(hi / 2pi), mul.rn: products that ptxas
    may not contract) and then the SFU's sin.approx / cos.approx on the reduced angle (|r| <= pi: abs error <=
    2^-20.9; the GPU test of every position 0..131072 holds the kernel to 1e-6). A sin of anything but a product
    (no reduction) keeps full precision: no sin.approx."""
    from coda.check import compile_variant
    from coda.config import GemmConfig
    epi = {"forward": rope, "backward": backward_epilogue(rope, ("out",), ()),
           "plain sin": coda.epilogue(lambda acc: coda.sin(acc) + coda.cos(acc), name="plain_sin")}[which]
    row = compile_variant(GemmConfig(), epi, count=("sin.approx", "cos.approx", "cvt.rni.f32.f32", "mul.rn.f32"))
    assert row["ok"], row
    assert row["wgmma"] > 0 and row["spill_bytes"] == 0
    c = row["count"]
    if which == "plain sin":
        assert c["sin.approx"] == 0 and c["cos.approx"] == 0 and c["cvt.rni.f32.f32"] == 0, c
        return
    assert c["sin.approx"] > 0 and c["sin.approx"] == c["cos.approx"] == c["cvt.rni.f32.f32"], c
    assert c["cvt.rni.f32.f32"] > 0 and c["mul.rn.f32"] > 0, c
