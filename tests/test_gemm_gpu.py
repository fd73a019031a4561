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


def run_check(M, N, K, dtype=torch.bfloat16, out_dtype=None, L=None, config=None, seed=None):
    g = torch.Generator(device="cuda").manual_seed(seed if seed is not None else torch.seed() % 2**31)
    lead = (L,) if L else ()
    a = torch.randn(*lead, M, K, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(*lead, N, K, device="cuda", dtype=dtype, generator=g)
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
