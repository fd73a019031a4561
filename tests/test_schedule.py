"""CPU (CI): the persistent kernel's tile order (coda/kernels/schedule.py's Python mirror of the kernel's arithmetic)
and the dynamic schedule's config rules and kernel argument. The kernel itself is checked on the H100
(tests/test_gemm_gpu.py::test_tiles_past_a_swizzle_group, tests/test_schedule_gpu.py and every other GPU test)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.config import GemmConfig, all_configs
from coda.kernels.schedule import tile_order


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), L=st.integers(1, 3), swizzle=st.sampled_from([1, 4, 8, 16]),
       raster_m=st.booleans())
def test_tile_order_visits_every_cluster_tile_once(rows, cols, L, swizzle, raster_m):
    """No padding: T = rows x cols x L indices, each cluster tile once (CUTLASS's scheduler pads the columns to
    whole swizzle groups and computes the padding)."""
    order = tile_order(rows, cols, L, swizzle, raster_m)
    assert sorted(order) == sorted((m, n, l) for m in range(rows) for n in range(cols) for l in range(L))


@pytest.mark.parametrize("raster_m", [True, False])
def test_tile_order_is_grouped_raster(raster_m):
    """Whole groups are walked as CUTLASS's swizzled layout does: along the group (swizzle tiles wide) fastest,
    then across it; the narrower last group (cols = 8 * 2 + 3) the same way."""
    rows, cols, sw = 5, 19, 8
    if not raster_m:
        rows, cols = cols, rows
    order = tile_order(rows, cols, 1, sw, raster_m)
    major, minor = (cols, rows) if raster_m else (rows, cols)
    i = 0
    for g in range(-(-major // sw)):
        width = min(sw, major - g * sw)
        for slow in range(minor):
            for f in range(width):
                fast = g * sw + f
                assert order[i] == ((slow, fast, 0) if raster_m else (fast, slow, 0))
                i += 1
    assert i == rows * cols


def test_dynamic_schedule_config_rules():
    from coda.autotune.space import config_from_dict, config_to_dict
    dyn = GemmConfig(tile_m=128, tile_n=256, cluster_m=1, cluster_n=1, sched="dynamic")
    assert dyn.validate().name.endswith("_dyn") and not GemmConfig().name.endswith("_dyn")
    assert not GemmConfig(sched="dynamic").problems()  # 2x1 clusters: the leader CTA passes the index on
    assert any("cooperative" in p for p in GemmConfig(cluster_m=1, pingpong=True, tile_m=128, tile_n=128,
                                                     sched="dynamic").problems())
    assert any("sched" in p for p in GemmConfig(sched="fifo").problems())
    assert dyn in list(all_configs())  # python -m coda.check and the GPU variant tests cover it
    assert config_from_dict(config_to_dict(dyn)) == dyn
    old = config_to_dict(GemmConfig())
    del old["sched"]  # an autotune cache entry written before the field existed
    assert config_from_dict(old) == GemmConfig()
    with pytest.raises(ValueError):
        config_from_dict(dict(old, bogus=1))


def test_heuristic_follows_the_waves_of_tiles_over_the_sms():
    """default_config models whole waves of tiles over the SMs (H100 timings: docs/NOTES.md, session 17): large
    problems keep 128x256 cooperative; problems of few tiles (decoding, weight gradients with a large K) take
    128x128 or 64x128 ping-pong tiles."""
    import itertools
    from coda.config import default_config

    def kind(c):
        return c.tile_m, c.tile_n, c.pingpong, c.cluster_m
    assert kind(default_config(8192, 8192, 8192)) == (128, 256, False, 2)
    for M, N in ((1, 4096), (64, 14336), (256, 4096), (1024, 1024)):
        assert kind(default_config(M, N, 4096)) == (64, 128, True, 1), (M, N)
    # 176 tiles of 128x256 are 2 waves on 132 SMs; 352 tiles of 128x128 are 3 waves of half-size tiles
    assert kind(default_config(5632, 1024, 8192)) == (128, 128, True, 2)
    # 128 tiles of 128x256 are one wave of 132 SMs, but two of 114
    assert default_config(4096, 1024, 8192).tile_n == 256 and default_config(4096, 1024, 8192, sms=114).tile_n == 128
    assert default_config(1024, 1024, 1024, batch=16).tile_n == 256  # a batch multiplies the tiles
    from coda._device import sm_count
    assert sm_count("cpu") == 132  # no CUDA device: an H100's wave
    for M, N in itertools.product((0, 1, 127, 129, 1000, 8191), (0, 8, 200, 4104, 128256)):
        c = default_config(M, N, 64)
        assert not c.problems() and (c.cluster_m == 1 or -(-M // c.tile_m) >= c.cluster_m), (M, N, c)  # no 2-CTA
        # cluster over a single M-tile; empty problems (M or N = 0) get a config too


def test_split_k_only_where_few_tiles_meet_a_long_k(monkeypatch):
    from coda import config
    from coda.config import split_k, split_k_us, gemm_us
    for M, N, K in ((8192, 8192, 8192), (8192, 4096, 4096), (8192, 28672, 4096), (8192, 4096, 14336),
                    (8192, 128256, 4096), (4096, 1024, 8192), (1000, 3000, 5000), (64, 14336, 4096)):
        assert split_k(M, N, K) == 1, (M, N, K)  # enough tiles, or a short K: one launch
    s = split_k(1024, 1024, 65536)  # 32 tiles of 128x256 for 1024 k-steps each
    assert s > 1 and 65536 % (64 * s) == 0 and split_k_us(1024, 1024, 65536, s, 2) < 0.9 * gemm_us(1024, 1024, 65536)
    assert split_k(1024, 2816, 32768) > 1  # a small layer's weight gradient over 32k tokens
    assert split_k(1024, 1024, 65536 + 8) == 1  # K not a whole number of 64-deep steps per slice
    assert split_k(512, 512, 32768) == 1  # ~150 us: the split's host work would not be hidden
    # the LM head's dX chunks (a Llama-3 vocabulary): 176 / 160 tiles of 128x256 on 132 SMs split by 3 / 4 (whole
    # waves); 4096 rows fill two waves unsplit (H100: 0.93 / 1.02 / 0.98x cuBLAS, coda.bench.split_k)
    assert [split_k(m, 2048, 128256) for m in (2816, 2560, 4096)] == [3, 4, 1]
    s = split_k(1024, 2816, 32768)
    assert s * 1024 * 2816 * 4 <= config.SPLIT_K_WORKSPACE
    monkeypatch.setattr(config, "SPLIT_K_WORKSPACE", 1024 * 2816 * 4)  # no room for two fp32 partials
    assert split_k(1024, 2816, 32768) == 1


@pytest.mark.parametrize("majors", ["kk", "mk", "km"])
def test_split_k_views_sum_to_the_product(majors):
    """The K-slices coda.gemm's split launches: strided views (no copy) that pass the kernel's layout rules and
    whose products sum to a @ b.T (checked on the reference path, which runs the same argument checks)."""
    import torch
    import coda
    from coda.gemm import split_k_views
    g = torch.Generator().manual_seed(0)

    def operand(rows, K, major):
        t = torch.randn(rows, K, generator=g, dtype=torch.float64)
        return (t if major == "k" else t.t().contiguous().t()).to(torch.bfloat16)
    a, b = operand(24, 1024, majors[0]), operand(16, 1024, majors[1])
    sa, sb = split_k_views(a, 4), split_k_views(b, 4)
    assert sa.shape == (4, 24, 256) and sa.data_ptr() == a.data_ptr() and sb.untyped_storage().data_ptr() == \
        b.untyped_storage().data_ptr()
    parts = coda.reference.gemm(sa, sb, out_dtype=torch.float32)
    full = a.double() @ b.double().t()
    assert parts.shape == (4, 24, 16)
    torch.testing.assert_close(parts.double().sum(0), full, rtol=1e-5, atol=1e-4)


def test_heuristic_default_is_dynamic_for_large_problems_and_the_tuner_tries_both():
    from coda.autotune import space
    from coda.config import default_config
    assert default_config(8192, 8192, 8192).sched == "dynamic" and not default_config(8192, 8192, 8192).problems()
    assert default_config(8192, 4096, 0).sched == "dynamic"  # K = 0 epilogue-only passes too
    assert default_config(256, 256, 256).pingpong and default_config(256, 256, 256).sched == "static"
    quick, _ = space.candidates(None, "bfloat16", "bfloat16", 8192, 8192, level="quick")
    scheds = {(c.tile_m, c.tile_n, c.cluster_m, c.cluster_n, c.raster): set() for c in quick if not c.pingpong}
    for c in quick:
        if not c.pingpong:
            scheds[(c.tile_m, c.tile_n, c.cluster_m, c.cluster_n, c.raster)].add(c.sched)
    assert scheds and all(s == {"static", "dynamic"} for s in scheds.values())
    assert all(c.sched == "static" for c in quick if c.pingpong)


def test_dynamic_counter_is_the_last_kernel_tensor():
    """coda.gemm appends the two-int32 counter after the epilogue's tensors for a dynamic config only."""
    import torch

    from coda.gemm import epilogue_tensors
    from coda.kernels.epilogue import IDENTITY
    from coda._validate import check_gemm_args
    a, b = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(48, 32, dtype=torch.bfloat16)
    prob = check_gemm_args(a, b)
    out3 = torch.empty(1, 64, 48, dtype=torch.bfloat16)
    args, _, _ = epilogue_tensors(IDENTITY, prob, {}, out3, GemmConfig(cluster_m=1))
    assert args == []
    args, _, _ = epilogue_tensors(IDENTITY, prob, {}, out3, GemmConfig(cluster_m=1, sched="dynamic"))
    (t, lead), = args
    assert t.dtype == torch.int32 and t.shape == (2,) and not t.any() and lead == 0


def test_captured_launch_counters_are_16_byte_aligned(monkeypatch):
    """Inside a CUDA-graph capture each dynamic launch takes its own counter pair from the pool; every pair starts
    a 16-byte slot (the DSL marshals kernel tensors as 16-byte aligned: a launch's first call inside a capture
    failed on odd pairs when they were 8 bytes apart). Simulated on CPU memory: the pool and the capture flag."""
    import importlib

    import torch
    gemm_mod = importlib.import_module("coda.gemm")
    pool = [torch.zeros(gemm_mod.COUNTER_SLOT * 8, dtype=torch.int32), 0]
    monkeypatch.setitem(gemm_mod._graph_pools, 0, pool)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    got = [gemm_mod._tile_counter(torch.device("cuda", 0)) for _ in range(5)]
    assert pool[1] == 5
    assert all(t.shape == (2,) and t.data_ptr() % 16 == 0 for t in got)
    assert len({t.data_ptr() for t in got}) == 5
