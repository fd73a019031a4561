"""CPU (CI): ``coda.kernels.rope_grad`` -- the kernel compiles for sm_90a with 16-byte accesses and no spills, its
launch plan reproduces the DSL's marshalling, bad arguments are refused by name; the reference is tested in
tests/test_attention.py and the kernel against it in tests/test_attention_gpu.py."""
import re

import pytest
import torch

from coda.kernels import rope_grad as rg
from test_ce_grad import needs_cutlass, sm90a_ptx


@needs_cutlass
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiles_for_sm90a_with_vector_accesses(dtype):
    text, out = sm90a_ptx(rg.compile_kernel, dtype)
    # per part: dy, y and 4 frequencies as 16-byte loads, dacc as a 16-byte store
    assert len(re.findall(r"ld\.global[.a-z0-9]*\.v4", text)) == 9
    assert len(re.findall(r"st\.global[.a-z0-9]*\.v4", text)) == 3
    assert text.count("sin.approx") and not re.findall(r"\b(?:ld|st)\.local", text)
    if out is not None:
        assert "0 bytes spill stores" in out and int(re.search(r"Used (\d+) registers", out).group(1)) <= 64


@needs_cutlass
def test_launch_plan_matches_the_dsl_marshalling():
    """The argument order (stream fourth, tensors otherwise) is what coda._launch.Plan reproduces: a plan is built
    from a real call's arguments (column blocks of one buffer, a single row padded view) without PlanError."""
    from coda import _launch
    for M in (64, 1):
        widths = (128, 32, 32)
        N = sum(widths)
        big, y = torch.randn(M, N).bfloat16(), torch.randn(M, N).bfloat16()
        views = [rg._as_rows(t) for t in (*big.split(widths, 1), *y.split(widths, 1))]
        views += [torch.zeros(M), torch.zeros(N // 2), torch.ones(M), rg._as_rows(torch.empty(M, N).bfloat16()),
                  torch.empty(M)]
        args = rg._launcher.cute_args(views, 0)
        fn = rg.compile_kernel(torch.bfloat16, fake=False, args=args)
        plan = _launch.Plan(fn, args, views, 0)
        assert len(plan.descs) == 11


def test_argument_errors_name_the_argument():
    g = [torch.randn(4, n) for n in (16, 8, 8)]
    y = [torch.randn(4, n) for n in (16, 8, 8)]
    pos, fr, r = torch.zeros(4), torch.zeros(16), torch.rand(4) + 0.5
    with pytest.raises(ValueError, match="dk"):
        rg.rope_grad([g[0], torch.randn(4, 9), g[2]], y, pos, fr, r)
    with pytest.raises(TypeError, match="dv"):
        rg.rope_grad([g[0], g[1], g[2].double()], y, pos, fr, r)
    with pytest.raises(ValueError, match="freqs"):
        rg.rope_grad(g, y, pos, fr[:-1], r)
    with pytest.raises(ValueError, match="pos"):
        rg.rope_grad(g, y, pos.double(), fr, r)
    with pytest.raises(ValueError, match="r must"):
        rg.rope_grad(g, y, pos, fr, r[:3])
    dacc, dr = rg.rope_grad(g, y, pos, fr, r)  # zero angles: dy scaled by r; dr the row dots over r
    assert torch.allclose(dacc, torch.cat(g, 1) * r[:, None])
    assert torch.allclose(dr, (torch.cat(g, 1) * torch.cat(y, 1)).sum(1) / r)
