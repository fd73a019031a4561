"""1 -> 2 (expand) epilogues on the CPU: ``coda.autodiff.on_acc`` turns the SwiGLU backward on the saved
pre-activation (a K = 0 program reading da as a TileMN operand) into the epilogue of the GEMM that forms da; the
reference path, the output-shape rules, and the kernel's build for sm_90a (no spills at the heuristic's epi_n)."""
import pytest
import torch

import coda
from coda.autodiff import grad_name, on_acc
from coda.dsl import ODD_OUT, DslEpilogue, EpilogueError
from coda.ops._common import epilogue_pass
from coda.ops.linear import backward_of
from coda.ops.mlp import dacc_on_da, rms_swiglu

WHICH = (("out",), ("r",), False)


def _inputs(M=37, H=64, I=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    return rnd(M, H), rnd(H, I), rnd(M, I), rnd(M, I), torch.rand(M, generator=g) + 0.5


def test_on_acc_equals_the_k0_program_on_da():
    """The fused program on dy W_down equals the K = 0 program given da = dy W_down as an operand (evaluated in
    float64 on the same fp32 da, so only the placement differs): dacc at columns 2j, 2j + 1, and d_r."""
    dy, wd, gp, up, r = _inputs()
    M, I = gp.shape
    prog = backward_of(rms_swiglu, *WHICH, preact=True)
    fused = dacc_on_da(WHICH)
    assert fused.expand and fused.pair_mode is None and fused.name.endswith("_on_acc")
    assert [o.name for o in fused.operands] == [o.name for o in prog.operands if o.name != grad_name("out")]
    da = dy.double() @ wd.double()
    ops = dict(r=r.double(), _preact_even=gp.double(), _preact_odd=up.double())
    want = prog.reference(torch.zeros(M, 2 * I, dtype=torch.float64), **{grad_name("out"): da}, **ops)
    got = fused.reference(da, **ops)
    assert got["out"].shape == (M, 2 * I)
    torch.testing.assert_close(got["out"], want["out"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["d_r"], want["d_r"], rtol=1e-12, atol=1e-12)


def test_expand_output_shape_and_nan():
    """coda.reference.gemm of an expand epilogue: an (M, 2N) result, ``out`` of (M, N) refused naming its shape; a
    NaN in g reaches both values of its pair and its row's d_r only."""
    dy, wd, gp, up, r = _inputs()
    M, I = gp.shape
    prog = dacc_on_da(WHICH)
    ops = dict(r=r, _preact_even=gp, _preact_odd=up)
    res = coda.reference.gemm(dy, wd.t(), epilogue=prog, **ops)
    assert res["out"].shape == (M, 2 * I) and res["d_r"].shape == (M,)
    with pytest.raises(ValueError, match=r"out: expected shape \(37, 48\)"):
        coda.reference.gemm(dy, wd.t(), epilogue=prog, out=torch.empty(M, I, dtype=torch.bfloat16), **ops)
    gp[3, 5] = float("nan")
    res = coda.reference.gemm(dy, wd.t(), epilogue=prog, **ops)
    bad = ~torch.isfinite(res["out"].float())
    assert bad[3, 10] and bad[3, 11] and bad.sum() == 2
    assert torch.isnan(res["d_r"][3]) and torch.isfinite(res["d_r"][torch.arange(M) != 3]).all()


def test_on_acc_rejects_what_it_cannot_fuse():
    prog = backward_of(rms_swiglu, *WHICH, preact=True)
    with pytest.raises(ValueError, match="no TileMN operand 'nope'"):
        on_acc(prog, "nope")
    with pytest.raises(ValueError, match="not a 2 -> 2 program"):
        on_acc(backward_of(rms_swiglu, *WHICH), grad_name("out"))  # reads the (recomputed) accumulator
    a = coda.dsl.sp.Symbol("acc")
    with pytest.raises(EpilogueError, match="1 -> 2 epilogue returns exactly two values"):
        DslEpilogue("x", (), {"out": a}, {}, expand=True)
    e = DslEpilogue("x", (), {"out": a, ODD_OUT: a}, {}, expand=True)
    assert e.key() != DslEpilogue("x", (), {"out": a, ODD_OUT: a}, {}, pair_mode="full").key()


@pytest.mark.slow
def test_builds_for_sm90a_without_spills():
    """The kernel of the fused SwiGLU backward at the heuristic config of the llama-1b da GEMM (8192 x 8192 x 2048:
    128x128 for a 1 -> 2 epilogue) compiles for sm_90a with WGMMAs and no spills."""
    pytest.importorskip("cutlass")
    import coda.autotune as at
    from coda._validate import check_gemm_args
    from coda.check import compile_variant
    prog = dacc_on_da(WHICH)
    a = torch.empty(8192, 2048, dtype=torch.bfloat16, device="meta")
    b = torch.empty(2048, 8192, dtype=torch.bfloat16, device="meta").t()
    prob = check_gemm_args(a, b, wide_out=True)
    cfg = at.heuristic(prob)
    assert (cfg.tile_m, cfg.tile_n, cfg.pingpong) == (128, 128, False)
    row = compile_variant(cfg, prog)
    assert row["ok"] and row["wgmma"] > 0 and row["spill_bytes"] == 0, row
