"""coda.segment_sum in the GEMM kernel (the consumer epilogue's pre-pass, coda/kernels/segment.py; first passed on
the H100 in session 47) vs float64: the 2x rule against torch's bf16 path, ragged
M and K, NaN-poisoned outputs all written, cooperative and ping-pong tiles, a pairs epilogue."""
import pytest
import torch

import coda
from coda.config import GemmConfig
from test_dsl_segment import qk64, rot_norm

pytestmark = pytest.mark.gpu
CFGS = [GemmConfig(tile_m=128, tile_n=256, cluster_m=2), GemmConfig(tile_m=64, tile_n=256, pingpong=True),
        GemmConfig(tile_m=128, tile_n=128)]


def _torch(z, heads, w_or_r, pairs):
    """The epilogues in torch on the accumulator z (float64, or bf16 with fp32 math: torch's own path)."""
    zf = z.float() if z.dtype != torch.float64 else z
    if pairs:  # rot_norm: groups of 64 columns, scaled by the row scale r
        g = zf.unflatten(-1, (zf.shape[-1] // 64, 64))
        y = (g * torch.rsqrt(g.pow(2).sum(-1, keepdim=True) / 64.0 + 1e-6)).flatten(-2) * w_or_r.to(zf).unsqueeze(-1)
    else:
        g = zf.unflatten(-1, (heads, 64))
        y = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(-2) * w_or_r.to(zf)
    return y


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: c.name)
@pytest.mark.parametrize("epi", [qk64, rot_norm], ids=lambda e: e.name)
def test_segment_sum_kernel_matches_float64(cfg, epi):
    torch.manual_seed(0)
    M, N, K = 1000, 1344, 520  # ragged M and K; N = 21 groups of 64 (the last tile partly outside N)
    pairs = epi is rot_norm
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wt = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    vec = torch.rand(M if pairs else N, device="cuda") + 0.5
    ops = dict(r=vec) if pairs else dict(w=vec, eps=1e-6)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = coda.gemm(x, wt, epilogue=epi, out=out, config=cfg, **ops)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any()  # every element written
    ref = _torch(x.double() @ wt.double().T, N // 64, vec.double(), pairs)
    mine = ((got.double() - ref).norm() / ref.norm()).item()
    theirs = ((_torch(x @ wt.T, N // 64, vec, pairs).bfloat16().double() - ref).norm() / ref.norm()).item()
    assert mine <= 2 * theirs + 1e-3, (mine, theirs)
    # the reference path agrees too (the same program, torch ops)
    want = coda.reference.gemm_wide(x.double(), wt.double(), epilogue=epi,
                                    **{k: (v.double() if torch.is_tensor(v) else v) for k, v in ops.items()})
    assert ((want - ref).norm() / ref.norm()).item() < 1e-12


def test_segment_sum_refused_in_the_epilogue_warps():
    """The epilogue warps do not run segment sums: ValueError naming them, before any launch (out untouched)."""
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.full((256, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="epi_wg"):
        coda.gemm(x, x[:128], epilogue=qk64, out=out, config=GemmConfig(epi_wg=True),
                  w=torch.rand(128, device="cuda"), eps=1e-6)
    torch.cuda.synchronize()
    assert out.isnan().all()
