"""``coda.segment_sum`` (coda/dsl_segment.py, issue 30): a segmented row reduction usable in epilogue arithmetic --
the reference against torch, the sympy backward (reverse mode: the argument's adjoint is the segment sum of the
node's) against autograd, the generated (hypothesis) epilogues with segment sums, and the kernel's refusal."""
import os

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import coda
from coda.autodiff import backward_epilogue, grad_name
from coda.dsl_segment import epilogue_segment_sizes
from gen_epilogues import SEGMENT, segment_in_where, specs
from test_dsl import SETTINGS, check_generated_gradients, check_generated_reference


@coda.epilogue
def qk_norm(acc, w: coda.VecN, eps: coda.Scalar):
    """Qwen3's QK-norm on groups of 4 columns: x rsqrt(mean over the head of x^2 + eps) w."""
    return acc * coda.rsqrt(coda.segment_sum(acc * acc, 4) / 4.0 + eps) * w


def _heads(z, size):
    return z.unflatten(-1, (z.shape[-1] // size, size))


def test_qk_norm_reference_matches_a_per_head_rms_norm():
    x, wt = torch.randn(37, 64, dtype=torch.bfloat16), torch.randn(24, 64, dtype=torch.bfloat16)
    w = torch.rand(24) + 0.5
    got = coda.reference.gemm(x, wt, epilogue=qk_norm, w=w, eps=1e-6, out_dtype=torch.float32)
    z = _heads(x.double() @ wt.double().T, 4)
    want = (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(-2) * w.double()
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
    assert epilogue_segment_sizes(qk_norm) == (4,)


def test_qk_norm_backward_matches_autograd():
    """dacc, dw and deps of the derived program (its segment sum of the upstream terms) vs float64 autograd."""
    g = torch.Generator().manual_seed(3)
    acc = torch.randn(6, 12, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(12, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    eps = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    z = _heads(acc, 4)
    out = (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * w
    up = torch.randn(out.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((out * up).sum(), (acc, w, eps))
    bwd = backward_epilogue(qk_norm, ("out",), ("w", "eps"))
    assert epilogue_segment_sizes(bwd) == (4,)  # the backward is a segment-sum program too
    got = bwd.reference(acc.detach(), w=w.detach(), eps=0.3, **{grad_name("out"): up})
    torch.testing.assert_close(got["out"], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got["d_w"], want[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got["d_eps"].sum(), want[2], rtol=1e-10, atol=1e-12)


def test_pairs_groups_count_pairs():
    """In a pairs epilogue a group is ``size`` pairs (a head of 8 columns = 4 pairs for a rotation's partner)."""
    @coda.epilogue
    def norm_pairs(acc):
        a, b = coda.pairs(acc)
        s = coda.segment_sum(a * a + b * b, 4)
        return a * coda.rsqrt(s), b * coda.rsqrt(s)

    acc = torch.randn(3, 16, dtype=torch.float64)
    got = norm_pairs.reference(acc)["out"]
    z = _heads(acc, 8)
    torch.testing.assert_close(got, (z * torch.rsqrt(z.pow(2).sum(-1, keepdim=True))).flatten(-2))


def test_errors():
    with pytest.raises(coda.EpilogueError, match="size must be a positive int"):
        @coda.epilogue
        def bad(acc):
            return coda.segment_sum(acc, 0)
    with pytest.raises(ValueError, match="do not tile the epilogue's 6 columns"):
        qk_norm.reference(torch.randn(2, 6), w=torch.rand(6), eps=0.1)

    @coda.epilogue
    def in_where(acc):
        return coda.where(acc > 0, coda.segment_sum(acc, 2), acc)
    with pytest.raises(ValueError, match="no elementwise derivative"):
        backward_epilogue(in_where, ("out",), ())
    # the kernel's pre-pass: where it cannot run (here the epilogue warps) a ValueError at the kernel's construction,
    # before any compile or launch
    from coda.config import GemmConfig
    from coda.kernels import segment
    assert segment.check(qk64, GemmConfig()) is True
    with pytest.raises(ValueError, match="epilogue warps"):
        segment.check(qk64, GemmConfig(epi_wg=True))
    with pytest.raises(ValueError, match="must be a multiple of 8"):  # groups of 4 columns
        segment.check(qk_norm, GemmConfig())


@st.composite
def _segment_specs(draw):
    """Generated epilogues with at least one segment sum (groups of 3 of the tests' 6 columns / 3 pairs)."""
    spec = draw(specs(segment=True))
    if not any(SEGMENT[0] in repr(p) for p in [spec["main"], *spec["extras"].values(),
                                               *(p for (_, _, p) in spec["reds"].values())]):
        spec["main"] = ("u", SEGMENT[0], spec["main"])
    return spec


@settings(max_examples=int(os.environ.get("CODA_DSL_EXAMPLES", 200)), **SETTINGS)
@given(spec=_segment_specs())
def test_generated_segment_reference_matches_torch(spec):
    check_generated_reference(spec)


@settings(max_examples=int(os.environ.get("CODA_DSL_EXAMPLES", 200)), **SETTINGS)
@given(spec=_segment_specs())
def test_generated_segment_gradients_match_autograd(spec):
    assume(all(op != "max" for (_, op, _) in spec["reds"].values()))
    assume(not segment_in_where(spec))  # (test_errors: no elementwise derivative there)
    check_generated_gradients(spec)


def test_linear_with_qk_norm_trains_on_the_cpu_reference_path():
    """coda.ops.linear (forward and the derived backward, CPU reference path) vs float64 autograd: within 2x of
    torch's own bf16 error, plus a small floor (fresh random inputs, ragged M)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(37, 64, generator=g).bfloat16()
    W = torch.randn(24, 64, generator=g).bfloat16()
    w = torch.rand(24, generator=g) + 0.5
    up = torch.randn(37, 24, generator=g)

    def run(x, W, w, f):
        x, W, w = (t.detach().clone().requires_grad_() for t in (x, W, w))
        y = f(x, W, w)
        (y.float() * up.to(y.device)).sum().backward()
        return [t.double() for t in (y.detach(), x.grad, W.grad, w.grad)]

    def torch_f(x, W, w):
        z = _heads(x @ W.T, 4)
        return (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2) * w.to(x.dtype)

    ours = run(x, W, w, lambda x, W, w: coda.ops.linear(x, W, epilogue=qk_norm, w=w, eps=1e-5))
    ref = run(x.double(), W.double(), w.double(), torch_f)
    bf = run(x, W, w, torch_f)
    for name, o, r, t in zip(("y", "dx", "dW", "dw"), ours, ref, bf):
        err, err_t = ((o - r).norm() / r.norm()).item(), ((t - r).norm() / r.norm()).item()
        assert err <= 2 * err_t + 1e-3, (name, err, err_t)


@coda.epilogue
def qk64(acc, w: coda.VecN, eps: coda.Scalar):
    """QK-norm over heads of 64 columns (the kernel's pre-pass: whole 8-column chunks inside a tile)."""
    return acc * coda.rsqrt(coda.segment_sum(acc * acc, 64) / 64.0 + eps) * w


@coda.epilogue
def rot_norm(acc, r: coda.VecM):
    """A pairs (2 -> 2) epilogue normalised over groups of 32 pairs (64 columns), times a row scale."""
    a, b = coda.pairs(acc)
    s = coda.rsqrt(coda.segment_sum(a * a + b * b, 32) / 64.0 + 1e-6)
    return a * s * r, b * s * r


@pytest.mark.parametrize("epi", [qk64, rot_norm], ids=lambda e: e.name)
def test_kernel_prepass_compiles_for_sm90a_without_spills(epi):
    """The consumer epilogue's pre-pass (coda/kernels/segment.py) builds for sm_90a at the cooperative and ping-pong
    tiles: WGMMAs present, no spills; the PTX has the quad's butterfly shuffles."""
    from coda.check import compile_variant
    from coda.config import GemmConfig
    for cfg in (GemmConfig(tile_m=128, tile_n=256, cluster_m=2), GemmConfig(tile_m=64, tile_n=256, pingpong=True)):
        row = compile_variant(cfg, epi, count=("shfl.sync.bfly",))
        assert row["ok"], row["error"]
        assert row["count"]["shfl.sync.bfly"] >= 2 * (cfg.tile_n // 64) * 2, row["count"]


def test_kernel_problems_are_named():
    from coda.config import GemmConfig
    from coda.dsl_segment import kernel_problems
    from coda.kernels import segment

    @coda.epilogue
    def with_tile(acc, t: coda.TileMN):
        return acc * coda.segment_sum(acc * t, 64)

    @coda.epilogue
    def nested(acc):
        return coda.segment_sum(coda.segment_sum(acc, 8) * acc, 64)

    assert kernel_problems(qk64, 256) == [] and kernel_problems(rot_norm, 128) == []
    assert "dividing tile_n=96" in kernel_problems(qk64, 96)[0]
    assert "reads TileMN operand(s) ['t']" in kernel_problems(with_tile, 256)[0]
    assert any("inside another's argument" in p for p in kernel_problems(nested, 256))
    with pytest.raises(ValueError, match="epilogue warps"):
        segment.check(qk64, GemmConfig(epi_wg=True))
    with pytest.raises(ValueError, match="must be a multiple of 8"):  # groups of 4 columns
        segment.check(qk_norm, GemmConfig())
    assert segment.check(qk64, GemmConfig()) is True and segment.check(coda.kernels.epilogue.Epilogue(),
                                                                        GemmConfig()) is False


def test_segment_cache_leaves_the_kernel_key_alone():
    """``segment_nodes`` caches the DAG's segment sums (first use: the kernel's construction); the compile cache's
    code fingerprint must not see the cache, or a kernel compiled by a precompile worker is never found."""
    from coda.dsl_segment import segment_nodes
    from coda.runtime.keys import code_fingerprint

    @coda.epilogue
    def fresh(acc, w: coda.VecN, eps: coda.Scalar):
        return acc * coda.rsqrt(coda.segment_sum(acc * acc, 8) / 8.0 + eps) * w

    @coda.epilogue
    def plain(acc, w: coda.VecN):  # (its cache is an empty list: a plain value the fingerprint would hash)
        return acc * w
    for epi, n in ((fresh, 1), (plain, 0)):
        before = code_fingerprint(epi)
        assert len(segment_nodes(epi)) == n and segment_nodes(epi) is segment_nodes(epi)  # (cached)
        assert code_fingerprint(epi) == before, epi.name
