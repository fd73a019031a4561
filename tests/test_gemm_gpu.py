"""CODA's GEMM on the H100 vs a float64 reference (the 2x rule), with NaN-poisoned outputs."""
import itertools

import pytest
import torch

import coda
from coda.config import GemmConfig, all_configs

pytestmark = pytest.mark.gpu

FLOOR = 1e-6


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _operand(lead, rows, K, major, **kw):
    """(…, rows, K) with K contiguous ("k") or rows contiguous ("mn", a transposed view)."""
    if major == "k":
        return torch.randn(*lead, rows, K, **kw)
    return torch.randn(*lead, K, rows, **kw).transpose(-1, -2)


def run_check(M, N, K, dtype=torch.bfloat16, out_dtype=None, L=None, config=None, seed=None, majors=("k", "k")):
    g = torch.Generator(device="cuda").manual_seed(seed if seed is not None else torch.seed() % 2**31)
    lead = (L,) if L else ()
    a = _operand(lead, M, K, majors[0], device="cuda", dtype=dtype, generator=g)
    b = _operand(lead, N, K, majors[1], device="cuda", dtype=dtype, generator=g)
    od = out_dtype or dtype
    out = torch.full((*lead, M, N), float("nan"), device="cuda", dtype=od)
    res = coda.gemm(a, b, out=out, config=config)
    torch.cuda.synchronize()
    assert res.data_ptr() == out.data_ptr()
    n_nan = torch.isnan(out).sum().item()
    assert n_nan == 0, f"{n_nan} of {out.numel()} output elements not written ({M}x{N}x{K} L={L} {config})"
    ref = torch.matmul(a.double(), b.double().transpose(-1, -2))
    theirs = torch.matmul(a, b.transpose(-1, -2)).to(od)
    e_ours, e_torch = rel_err(out, ref), rel_err(theirs, ref)
    assert e_ours <= 2 * e_torch + FLOOR, f"{M}x{N}x{K} L={L} {dtype}->{od} {config}: err {e_ours:.3g} vs torch {e_torch:.3g}"


@pytest.mark.parametrize("M,N,K", list(itertools.product([1, 127, 8191], [8, 200, 4104], [8, 72, 4104])))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shapes_default_config(M, N, K, dtype):
    run_check(M, N, K, dtype)


@pytest.mark.parametrize("cfg", list(all_configs()), ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_variant(cfg, dtype):
    run_check(1000, 904, 456, dtype, config=cfg)  # ragged in every dim, several tiles and k-tiles
    run_check(300, 136, 200, dtype, L=3, config=cfg)


MN_CONFIGS = [GemmConfig(tile_m=128, tile_n=256, cluster_m=2), GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2),
              GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, cluster_n=2),
              GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=2)]


@pytest.mark.parametrize("majors", [("mn", "k"), ("k", "mn"), ("mn", "mn")], ids="".join)
@pytest.mark.parametrize("cfg", MN_CONFIGS, ids=lambda c: c.name)
def test_mn_major_operands(cfg, majors):
    """Transposed views (x.t(), w.t()): the backward GEMMs dX = dY W and dW = dY^T X read them without copies."""
    for dtype in (torch.bfloat16, torch.float16):
        run_check(1000, 904, 456, dtype, config=cfg, majors=majors)
    run_check(304, 136, 200, torch.bfloat16, L=3, config=cfg, majors=majors)
    run_check(8, 8, 4104, torch.bfloat16, config=cfg, majors=majors)


K32_CONFIGS = [GemmConfig(tile_m=128, tile_n=256, cluster_m=2, tile_k=32),
               GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=2, tile_k=32),
               GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=2, sched="dynamic", tile_k=32)]


@pytest.mark.parametrize("majors", [("k", "k"), ("mn", "k"), ("k", "mn"), ("mn", "mn")], ids="".join)
@pytest.mark.parametrize("cfg", K32_CONFIGS, ids=lambda c: c.name)
def test_half_depth_stages(cfg, majors):
    """tile_k=32: stages of 32 k-elements (a 64-byte swizzled row of K-major operands), twice as many of them;
    K ragged against 32 and shorter than one stage."""
    for dtype in (torch.bfloat16, torch.float16):
        run_check(1000, 904, 456, dtype, config=cfg, majors=majors)
    run_check(304, 136, 200, torch.bfloat16, L=3, config=cfg, majors=majors)
    run_check(136, 264, 24, torch.bfloat16, config=cfg, majors=majors)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_out_dtypes(out_dtype):
    run_check(517, 264, 1032, torch.bfloat16, out_dtype=out_dtype)
    run_check(517, 264, 1032, torch.bfloat16, out_dtype=out_dtype, config=GemmConfig(tile_m=128, tile_n=128,
                                                                                       pingpong=True, cluster_m=1))


def test_batched_broadcast_weight():
    a = torch.randn(3, 129, 264, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(72, 264, device="cuda", dtype=torch.bfloat16)
    out = coda.gemm(a, b)
    ref = torch.matmul(a.double(), b.double().T)
    assert rel_err(out, ref) <= 2 * rel_err(torch.nn.functional.linear(a, b), ref) + FLOOR


def test_large_square():
    run_check(8192, 8192, 8192, torch.bfloat16)


def test_tensors_that_require_grad_are_read_not_tracked():
    a = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = coda.gemm(a, b)
    assert not out.requires_grad
    torch.testing.assert_close(out.float(), (a.detach().float() @ b.detach().float().T), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("N,K", [(1024, 1024), (2816, 1032), (4104, 136)])
def test_tiles_past_a_swizzle_group(N, K):
    """Column-tile counts that are not a multiple of the raster's swizzle group (4, 11, 17 tiles of 256 for a
    group of 8): the narrower last group (schedule.py) must still cover every tile once."""
    run_check(8192, N, K, torch.bfloat16)
    run_check(1000, N, K, torch.bfloat16, L=2, config=GemmConfig(raster="n", swizzle=4))


@pytest.mark.parametrize("majors", [("k", "k"), ("mn", "k"), ("k", "mn")], ids="".join)
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_split_k(monkeypatch, majors, dtype, out_dtype):
    """Few output tiles and a long K: coda.gemm (config=None) runs coda.config.split_k's K-slices as one batched
    launch and sums them; the 2x rule, every element written, ragged M / N, transposed operands; out=None equal."""
    import importlib
    from coda.config import split_k
    module = importlib.import_module("coda.gemm")
    calls = []
    real = module._split_k
    monkeypatch.setattr(module, "_split_k", lambda *a: calls.append(a[-1]) or real(*a))
    for M, N, K in ((1000, 1000, 65536), (1024, 2816, 32768)):
        assert split_k(M, N, K, out_dtype.itemsize) > 1
        run_check(M, N, K, dtype, out_dtype=out_dtype, majors=majors)
    assert calls == [split_k(1000, 1000, 65536, out_dtype.itemsize), split_k(1024, 2816, 32768, out_dtype.itemsize)]
    a = torch.randn(1000, 65536, device="cuda", dtype=dtype)
    b = torch.randn(1000, 65536, device="cuda", dtype=dtype)
    out = torch.full((1000, 1000), float("nan"), device="cuda", dtype=out_dtype)
    assert torch.equal(coda.gemm(a, b, out_dtype=out_dtype), coda.gemm(a, b, out=out))
    # an explicit config is the kernel asked for: no split
    n = len(calls)
    coda.gemm(a, b, out=out, config=GemmConfig())
    assert len(calls) == n
