"""CPU (CI): the persistent kernel's tile order (coda/kernels/schedule.py's Python mirror of the kernel's arithmetic).
The kernel itself is checked on the H100 (tests/test_gemm_gpu.py::test_tiles_past_a_swizzle_group and every other
GPU test)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
