"""CPU (CI): the stream-K work schedule (coda/kernels/schedule.py's Python mirror of the kernel's arithmetic) and the
stream-K config rules. The kernel itself is checked on the H100 (tests/test_gemm_gpu.py::test_streamk_*)."""
import collections
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.config import TILE_K, GemmConfig, all_configs, default_config
from coda.kernels.schedule import schedule, tile_order


def _check(T, P, k, enabled=True):
    sched = schedule(T, P, k, enabled)
    assert len(sched) == P
    cover = collections.Counter()
    contributors = collections.defaultdict(list)
    for c, units in enumerate(sched):
        for i, (t, kb, ke) in enumerate(units):
            assert 0 <= t < T and 0 <= kb < ke <= k, (c, t, kb, ke)
            cover.update((t, j) for j in range(kb, ke))
            contributors[t].append((c, kb, ke))
            if kb > 0:  # a tail segment is its cluster's first split unit (after whole tiles only) ...
                assert all(u[1:] == (0, k) for u in units[:i]), (c, units)
            if ke < k:  # ... a head segment its last unit
                assert i == len(units) - 1 and kb == 0, (c, units)
    # every (tile, k-tile) exactly once
    assert len(cover) == T * k and set(cover.values()) == {1}
    for t, parts in contributors.items():
        assert len(parts) <= 2, (t, parts)
        if len(parts) == 2:  # head by cluster c, tail by c + 1: the tail's slot is the one the head reads
            (c0, kb0, ke0), (c1, kb1, ke1) = sorted(parts)
            assert c1 == c0 + 1 and kb0 == 0 and kb1 == ke0 and ke1 == k
    return sched


@settings(max_examples=300, deadline=None)
@given(T=st.integers(1, 3000), P=st.integers(1, 140), k=st.integers(1, 300))
def test_schedule_covers_every_k_tile_once(T, P, k):
    _check(T, P, k)


@pytest.mark.parametrize("T,P,k", [(1024, 66, 128), (512, 66, 64), (3584, 66, 64), (512, 66, 224),
                                   (16032, 66, 64), (1088, 132, 65)])
def test_schedule_balances_the_last_wave(T, P, k):
    """The Llama / issue-2 shapes (cluster tiles of 128 x 256 CTA tiles, 66 clusters of 2 on 132 SMs): the
    busiest cluster does (W - 1) * k + ceil((P + R) * k / P) k-tiles instead of ceil(T / P) * k."""
    sched = _check(T, P, k)
    loads = [sum(ke - kb for _, kb, ke in units) for units in sched]
    W, R = divmod(T, P)
    assert max(loads) == (W - 1) * k + math.ceil((P + R) * k / P)
    assert max(loads) - min(loads) <= 1
    assert max(loads) <= math.ceil(T * k / P)
    dp = max(sum(ke - kb for _, kb, ke in u) for u in schedule(T, P, k, enabled=False))
    assert dp == math.ceil(T / P) * k and max(loads) < dp


@pytest.mark.parametrize("T,P,k", [(132, 66, 64), (40, 66, 64), (1000, 66, 1), (0, 66, 64)])
def test_schedule_is_data_parallel_without_a_partial_wave(T, P, k):
    """No partial wave (R = 0), fewer tiles than clusters (W = 0) or a single k-tile: plain data-parallel."""
    assert schedule(T, P, k) == schedule(T, P, k, enabled=False)
    for c, units in enumerate(schedule(T, P, k)):
        assert units == [(c + i * P, 0, k) for i in range(len(units))]


def test_streamk_is_cooperative_only():
    assert GemmConfig(streamk=True).problems() == []
    assert any("streamk" in p for p in GemmConfig(tile_m=128, tile_n=128, pingpong=True, streamk=True).problems())
    with pytest.raises(ValueError, match="streamk"):
        GemmConfig(tile_m=128, tile_n=128, pingpong=True, streamk=True).validate()
    names = [c.name for c in all_configs()]
    assert all(c.name.endswith("_sk") == c.streamk for c in all_configs()) and len(set(names)) == len(names)
    assert {(c.tile_m, c.tile_n, c.cluster_m, c.cluster_n) for c in all_configs() if c.streamk} == {
        (c.tile_m, c.tile_n, c.cluster_m, c.cluster_n) for c in all_configs() if not c.pingpong}


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
