"""In-kernel split-K (``GemmConfig.splits``) on the H100 vs a float64 reference (the 2x rule of test_gemm_gpu),
NaN-poisoned outputs: few-tile, long-K shapes (ragged too), epilogues with staged operands, a row reduction and a
TileMN operand (loaded by the final split only), determinism, the flags' reset between launches and CUDA-graph
replays."""
import pytest
import torch

import coda
from coda.config import GemmConfig
from coda.epilogues.scale_bias import ScaleBiasSumsq

from test_gemm_gpu import rel_err, run_check
from test_schedule_gpu import graph_replays_equal

pytestmark = pytest.mark.gpu

CFGS = [GemmConfig(cluster_m=1, splits=2), GemmConfig(splits=4), GemmConfig(tile_n=128, cluster_m=1, splits=3),
        GemmConfig(cluster_m=1, cluster_n=2, splits=8), GemmConfig(cluster_m=1, splits=16)]


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: c.name)
@pytest.mark.parametrize("M,N,K", [(512, 512, 32768), (200, 136, 16384), (1024, 2816, 8192), (384, 1000, 4160)])
def test_split_k_matches_float64(cfg, M, N, K):
    run_check(M, N, K, config=cfg)


@pytest.mark.parametrize("majors", [("k", "mn"), ("mn", "mn")])
def test_split_k_layouts_and_fp32_out(majors):
    run_check(1024, 768, 16384, config=GemmConfig(cluster_m=1, splits=4), majors=majors)
    run_check(640, 512, 8192, out_dtype=torch.float32, config=GemmConfig(cluster_m=1, splits=6))
    run_check(304, 136, 8192, L=3, config=GemmConfig(cluster_m=1, splits=4), majors=majors)  # batched (M: 16-byte rows)


def test_split_k_is_deterministic_and_resets_its_flags():
    """Bitwise equal results over repeated launches (the partials are added in split order; a flag left raised
    would let a later launch read a stale partial), then another shape and config on the same buffers."""
    a, b = torch.randn(512, 32768, device="cuda", dtype=torch.bfloat16), torch.randn(512, 32768, device="cuda",
                                                                                      dtype=torch.bfloat16)
    cfg = GemmConfig(cluster_m=1, splits=8)
    first = coda.gemm(a, b, config=cfg)
    for _ in range(5):
        assert torch.equal(coda.gemm(a, b, config=cfg), first)
    run_check(256, 256, 65536, config=GemmConfig(cluster_m=1, splits=16))
    assert torch.equal(coda.gemm(a, b, config=cfg), first)


def test_split_k_epilogues_run_once_on_the_summed_tile():
    """Staged VecM / VecN operands and a per-row reduction (ScaleBiasSumsq), and a TileMN operand: the epilogue runs
    once per tile, on the sum of the splits."""
    g = torch.Generator(device="cuda").manual_seed(3)
    M, N, K = 300, 520, 16384
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = torch.rand(M, device="cuda", generator=g) + 0.5
    bias = torch.randn(N, device="cuda", generator=g)
    ref = (a.double() @ b.double().T) * scale.double()[:, None] + bias.double()
    for cfg in (GemmConfig(cluster_m=1, splits=4), GemmConfig(tile_n=128, cluster_m=1, splits=8)):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        res = coda.gemm(a, b, epilogue=ScaleBiasSumsq(), out=out, scale=scale, bias=bias, config=cfg)
        assert not torch.isnan(out).any()
        assert rel_err(out, ref) < 1e-2
        assert rel_err(res["sumsq"], (ref * ref).sum(-1)) < 2e-2

    @coda.epilogue
    def add_res(acc, res: coda.TileMN):
        return acc + res

    r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    out = coda.gemm(a, b, epilogue=add_res, res=r, config=GemmConfig(cluster_m=1, splits=4))
    assert rel_err(out, a.double() @ b.double().T + r.double()) < 1e-2


def test_split_k_in_a_cuda_graph():
    """A captured split-K launch has buffers of its own (its flags zeroed by a captured memset): replays equal eager."""
    a, b = torch.randn(512, 16384, device="cuda", dtype=torch.bfloat16), torch.randn(640, 16384, device="cuda",
                                                                                      dtype=torch.bfloat16)
    cfg = GemmConfig(cluster_m=1, splits=4)
    graph_replays_equal(a, b, cfg, coda.gemm(a, b, config=cfg))
