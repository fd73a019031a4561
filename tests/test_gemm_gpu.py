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


# ---- stream-K (coda/kernels/schedule.py): the last wave split into k-ranges, partials fixed up through a workspace
SK_CONFIGS = [c for c in all_configs() if c.streamk]


def _split_shape(cfg, K, L=1):
    """(M, N) whose last wave ``cfg`` splits: the kernel's schedule (its Python mirror) has split tiles."""
    from coda.gemm import _max_active_clusters
    from coda.kernels.schedule import schedule
    P = _max_active_clusters(cfg.cluster_m * cfg.cluster_n)
    for M, N in [(4000, 2104), (8191, 4104), (3000, 5000), (6000, 3000), (2000, 9000)]:
        rows = -(-(-(-M // cfg.tile_m)) // cfg.cluster_m)
        cols = -(-(-(-N // cfg.tile_n)) // cfg.cluster_n)
        if any(kb > 0 for units in schedule(rows * cols * L, P, -(-K // 64)) for _, kb, _ in units):
            return M, N
    raise AssertionError(f"no shape splits the last wave of {cfg.name}")


@pytest.mark.parametrize("cfg", SK_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("K", [136, 1032])
def test_streamk_exact_on_integers(cfg, K):
    """Small-integer inputs make every fp32 sum exact, so the output must equal the fp64 reference bit for bit: a
    k-tile counted twice or dropped by the split shows. Fresh inputs on every launch, so a flag left raised by the
    previous launch (a stale partial) would show too."""
    M, N = _split_shape(cfg, K)
    for _ in range(3):
        a = torch.randint(-2, 3, (M, K), device="cuda").to(torch.bfloat16)
        b = torch.randint(-2, 3, (N, K), device="cuda").to(torch.bfloat16)
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float32)
        coda.gemm(a, b, out=out, config=cfg)
        ref = a.double() @ b.double().T
        assert torch.equal(out.double(), ref), f"{cfg.name} {M}x{N}x{K}: {(out.double() - ref).abs().max().item()}"


@pytest.mark.parametrize("cfg", [GemmConfig(streamk=True), GemmConfig(tile_m=256, tile_n=128, cluster_m=1,
                                                                        cluster_n=2, streamk=True)],
                         ids=lambda c: c.name)
def test_streamk_random_batched_and_transposed(cfg):
    """The 2x rule with random data: batched (the split runs across batches), ragged K, MN-major operands (the
    backward's dW = dY^T X), fp16; and bitwise determinism (head + tail, always in that order)."""
    M, N = _split_shape(cfg, 1000, L=3)
    run_check(M, N, 1000, torch.bfloat16, L=3, config=cfg)
    M, N = _split_shape(cfg, 1032)
    run_check(M, N, 1032, torch.float16, config=cfg, majors=("mn", "mn"))
    a = torch.randn(M, 1032, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, 1032, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(coda.gemm(a, b, config=cfg), coda.gemm(a, b, config=cfg))


def test_streamk_two_streams():
    """Kernels on two streams at once use separate workspaces (a shared one would mix their partials)."""
    cfg = GemmConfig(streamk=True)
    M, N = _split_shape(cfg, 2056)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    jobs = []
    torch.cuda.synchronize()
    for i in range(6):
        s = streams[i % 2]
        with torch.cuda.stream(s):
            a = torch.randint(-2, 3, (M, 2056), device="cuda").to(torch.bfloat16)
            b = torch.randint(-2, 3, (N, 2056), device="cuda").to(torch.bfloat16)
            jobs.append((a, b, coda.gemm(a, b, out_dtype=torch.float32, config=cfg)))
    torch.cuda.synchronize()
    for a, b, out in jobs:
        assert torch.equal(out.double(), a.double() @ b.double().T)
