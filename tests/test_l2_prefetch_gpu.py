"""GemmConfig.l2_prefetch on the GPU: a prefetch is a hint, so every output is bitwise the one of the same config
without it -- the in-place AdamW update of a dW GEMM (p, m, v; the shipped update configs, ragged and few-tile
shapes) and a TileMN residual epilogue (NaN-poisoned output, ping-pong and cooperative tiles, a ragged shape) --,
and the residual epilogue matches float64 within 2x torch's bf16 error."""
import dataclasses

import pytest
import torch

import coda
from coda.config import GemmConfig
from coda.epilogues.adamw import adamw
from coda.optim import update_config
from test_l2_prefetch import scaled_residual
from test_optim_gpu import _hyper

pytestmark = pytest.mark.gpu
BF = dict(device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("shape", [(1000, 776, 520), (3072, 2048, 4096)])
@pytest.mark.parametrize("few", [True, False], ids=["few_tiles", "epi_wg"])
def test_adamw_update_bitwise_with_prefetch(shape, few):
    torch.manual_seed(0)
    N, K, T = shape
    cfg = update_config(mn=(N, K)) if few else update_config(mn=(1 << 20, 1 << 20))
    dy, x = torch.randn(T, N, **BF), torch.randn(T, K, **BF)
    p0, m0 = torch.randn(N, K, **BF), (torch.randn(N, K, device="cuda") * 0.1).to(torch.bfloat16)
    v0 = (torch.rand(N, K, device="cuda") * 0.01).to(torch.bfloat16)
    outs = []
    for c in (cfg, dataclasses.replace(cfg, l2_prefetch=16)):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        coda.gemm(dy.t(), x.t(), epilogue=adamw, out=p, p=p, m=m, v=v, config=c, **_hyper(3))
        outs.append((p, m, v))
    torch.cuda.synchronize()
    for name, a, b in zip("pmv", *outs):
        assert torch.equal(a, b), name
    assert not torch.equal(outs[0][0], p0)  # the update ran


@pytest.mark.parametrize("cfg", [GemmConfig(), GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=1),
                                 GemmConfig(tile_m=128, tile_n=128, cluster_m=2, sched="dynamic")],
                         ids=lambda c: c.name)
def test_residual_epilogue_bitwise_with_prefetch(cfg):
    torch.manual_seed(1)
    M, N, K = 1000, 1544, 2056
    a, b, r = torch.randn(M, K, **BF), torch.randn(N, K, **BF), torch.randn(M, N, **BF)
    s = torch.tensor([0.37], device="cuda")
    outs = []
    for c in (cfg, dataclasses.replace(cfg, l2_prefetch=8), dataclasses.replace(cfg, l2_prefetch=cfg.tile_m)):
        out = torch.full((M, N), float("nan"), **BF)
        coda.gemm(a, b, epilogue=scaled_residual, out=out, r=r, s=s, config=c)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0]).all()
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    want = (a.double() @ b.double().T) * 0.37 + r.double()
    theirs = ((a @ b.T) * 0.37 + r).double()
    err = lambda t: ((t.double() - want).norm() / want.norm()).item()  # noqa: E731
    assert err(outs[0]) <= 2 * err(theirs) + 1e-6
